"""`skip_first_batches`: a copy of a dataloader whose epochs start after their first batches (to resume
mid-epoch), and HF's `SkipDataLoader`."""

from __future__ import annotations

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from accel.data.dispatcher import DataLoaderDispatcher
from accel.data.loaders import copied_kwargs
from accel.data.samplers import SkipBatchSampler
from accel.data.shard_loader import DataLoaderShard

__all__ = ["SkipDataLoader", "skip_first_batches"]


class SkipDataLoader(DataLoaderShard):
    """A `DataLoader` whose iterations skip their first `skip_batches` batches (HF Accelerate's class, which
    `skip_first_batches` returns for a plain, unprepared loader over an iterable dataset).

    It registers with `GradientState` while iterated and, unlike HF's, knows its last batch (`end_of_dataloader`),
    as every prepared loader does. Prefer `skip_first_batches`, or a stateful loader.

    Args:
        dataset: The dataset.
        skip_batches: The number of batches to skip at the start of each iteration.
        use_stateful_dataloader: Build it on torchdata's `StatefulDataLoader`.
        **kwargs: `torch.utils.data.DataLoader` arguments.
    """

    def __init__(self, dataset, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs):
        super().__init__(dataset, skip_batches=skip_batches, use_stateful_dataloader=use_stateful_dataloader, **kwargs)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A copy of `dataloader` whose epochs start after their first `num_batches` batches (to resume mid-epoch).

    `num_batches` counts the batches this process saw (global batches for a `DataLoaderDispatcher`). A prepared
    loader keeps its settings (device, RNG synchronization, epoch, even_batches); its RNG state is not changed,
    so restore it (`load_state`) or use a seedable sampler with `set_epoch` to get the same order as before.

    Example:
        ```python
        for step, batch in enumerate(loader):
            if step == 3:
                break  # saw batches 0, 1, 2, 3
        resumed = skip_first_batches(loader, 4)  # yields batch 4 onwards of the same epoch order
        ```
    """
    if isinstance(dataloader, DataLoaderDispatcher):
        return _skipped_dispatcher(dataloader, num_batches)
    kwargs = copied_kwargs(dataloader)
    if isinstance(dataloader, DataLoaderShard):
        kwargs.update(
            device=dataloader.device,
            rng_types=dataloader.rng_types,
            synchronized_generator=dataloader.synchronized_generator,
            _drop_last=dataloader._drop_last,
            _non_blocking=dataloader._non_blocking,
            iteration=dataloader.iteration,
        )
    else:
        kwargs.update(_drop_last=dataloader.drop_last)
    if isinstance(dataloader.dataset, IterableDataset):
        skipping = DataLoaderShard if isinstance(dataloader, DataLoaderShard) else SkipDataLoader
        return skipping(
            dataloader.dataset,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            skip_batches=num_batches,
            **kwargs,
        )
    if isinstance(dataloader.sampler, BatchSampler):
        skipped = SkipBatchSampler(dataloader.sampler, num_batches)
        kwargs.update(sampler=skipped, batch_size=dataloader.batch_size)
    else:
        kwargs.update(batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches))
    if isinstance(dataloader, DataLoaderShard):
        return DataLoaderShard(dataloader.dataset, **kwargs)
    kwargs.pop("_drop_last")
    return DataLoader(dataloader.dataset, **kwargs)


def _skipped_dispatcher(dataloader: DataLoaderDispatcher, num_batches: int) -> DataLoaderDispatcher:
    kwargs = copied_kwargs(dataloader)
    kwargs.update(
        split_batches=dataloader.split_batches,
        even_batches=dataloader.even_batches,
        device=dataloader.device,
        slice_fn=dataloader.slice_fn,
        _drop_last=dataloader._drop_last,
        _non_blocking=dataloader._non_blocking,
        iteration=dataloader.iteration,
    )
    sampler = dataloader._index_batch_sampler()
    if sampler is None:
        return DataLoaderDispatcher(
            dataloader.dataset,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            skip_batches=num_batches,
            **kwargs,
        )
    # A global batch joins num_processes batches of the wrapped sampler unless they are split.
    per_step = 1 if dataloader.split_batches else dataloader.state.num_processes
    skipped = SkipBatchSampler(sampler, num_batches * per_step)
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoaderDispatcher(dataloader.dataset, sampler=skipped, batch_size=dataloader.batch_size, **kwargs)
    return DataLoaderDispatcher(dataloader.dataset, batch_sampler=skipped, **kwargs)
