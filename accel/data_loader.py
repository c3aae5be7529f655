"""`accelerate.data_loader`'s import path: a re-export of `accel.data`."""

from accel.data.loaders import (  # noqa: F401
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)
from accel.data.samplers import (  # noqa: F401
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
)

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
