"""`join_uneven_inputs(even_batches=...)`: overriding, for a block, how prepared loaders end their epochs."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from torch.utils.data import DataLoader, IterableDataset

from accel.data.dispatcher import DataLoaderDispatcher
from accel.data.loaders import DataLoaderAdapter
from accel.data.samplers import BatchSamplerShard, SkipBatchSampler

__all__ = ["override_even_batches"]


def _even_batches_owner(loader: DataLoader) -> Any:
    """The object whose `even_batches` decides how `loader` ends an epoch: a dispatcher itself, or the
    `BatchSamplerShard` of a sharded map-style loader; None for an iterable dataset (as in HF Accelerate, whose
    join_uneven_inputs leaves those as they are and warns)."""
    if isinstance(loader, DataLoaderDispatcher):
        return None if isinstance(loader.dataset, IterableDataset) else loader
    sampler = loader._index_batch_sampler() if isinstance(loader, DataLoaderAdapter) else loader.batch_sampler
    while isinstance(sampler, SkipBatchSampler):
        sampler = sampler.batch_sampler
    return sampler if isinstance(sampler, BatchSamplerShard) else None


def override_even_batches(loaders: list, even_batches: bool) -> Callable[[], None]:
    """Sets `even_batches` of every prepared loader in `loaders` that has one; returns the function that restores
    them. Warns about loaders that have none (iterable datasets), as HF Accelerate does."""
    owners = [_even_batches_owner(loader) for loader in loaders]
    if any(owner is None for owner in owners):
        warnings.warn(
            "Overriding even_batches is only supported for map-style datasets, yet some dataloaders given were iterable"
        )
    saved = [(owner, owner.even_batches) for owner in owners if owner is not None]
    for owner, _ in saved:
        owner.even_batches = even_batches

    def restore() -> None:
        for owner, value in saved:
            owner.even_batches = value

    return restore
