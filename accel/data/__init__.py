"""Sharded data loading: samplers, prepared dataloaders, RNG synchronization and gather_for_metrics truncation."""

from accel.data.loaders import (
    DataLoaderAdapter,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    SkipDataLoader,
    gather_for_metrics_truncation,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)
from accel.data.rng import RNGType, set_seed, synchronize_rng_state, synchronize_rng_states
from accel.data.samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler

__all__ = [
    "BatchSamplerShard",
    "DataLoaderAdapter",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "RNGType",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "gather_for_metrics_truncation",
    "get_sampler",
    "prepare_data_loader",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_state",
    "synchronize_rng_states",
]
