"""Sharded data loading: samplers, prepared dataloaders, RNG synchronization and gather_for_metrics truncation."""

from accel.data.dispatcher import DataLoaderDispatcher
from accel.data.even_batches import override_even_batches
from accel.data.loaders import DataLoaderAdapter, DataLoaderStateMixin, get_sampler
from accel.data.prepare import prepare_data_loader
from accel.data.rng import RNGType, set_seed, synchronize_rng_state, synchronize_rng_states
from accel.data.samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler
from accel.data.shard_loader import DataLoaderShard
from accel.data.skip import SkipDataLoader, skip_first_batches
from accel.data.truncation import gather_for_metrics, gather_for_metrics_truncation

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
    "gather_for_metrics",
    "gather_for_metrics_truncation",
    "get_sampler",
    "override_even_batches",
    "prepare_data_loader",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_state",
    "synchronize_rng_states",
]
