"""`DataLoaderShard`: a prepared `DataLoader` whose every process reads its own share of the data.

Its sampler is a `BatchSamplerShard` (or its dataset an `IterableDatasetShard`); at each epoch it synchronizes the
RNGs, places batches on the device and reads one batch ahead, to know before yielding it whether a batch is the
last one (`end_of_dataloader`) and how many real samples the last global batch holds (`remainder`).
"""

from __future__ import annotations

import math
from typing import Iterator

from torch.utils.data import IterableDataset

from accel.data.loaders import DataLoaderAdapter, last_step_sizes, place_batch, uneven_role
from accel.data.rng import synchronize_rng_states
from accel.data.samplers import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler, sampler_num_samples

__all__ = ["DataLoaderShard"]


class DataLoaderShard(DataLoaderAdapter):
    """A `DataLoader` whose sampler or dataset is sharded, with device placement and RNG synchronization.

    At each `iter()`: synchronizes `rng_types` from process 0, calls `set_epoch(self.iteration)`, then yields the
    batches on `device`, reading one batch ahead to know which one is last; `iteration` counts finished epochs.

    Args:
        dataset: The (possibly `IterableDatasetShard`-wrapped) dataset.
        device: Where to put the batches (None: leave them where collate put them).
        rng_types: Generators to synchronize at the start of each epoch ("torch", "cuda", "generator").
        synchronized_generator: The generator "generator" refers to (the sampler's or the dataset's).
        skip_batches: Batches to skip at the start of each epoch (for an iterable dataset).
        _drop_last: The original loader's `drop_last`.
        _non_blocking: Copy to `device` with `non_blocking=True`.
        iteration: The epoch to start at.
        **kwargs: `torch.utils.data.DataLoader` arguments.
    """

    def __init__(
        self,
        dataset,
        device=None,
        rng_types=None,
        synchronized_generator=None,
        skip_batches: int = 0,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        iteration: int = 0,
        **kwargs,
    ):
        super().__init__(
            dataset,
            _drop_last=_drop_last,
            _non_blocking=_non_blocking,
            skip_batches=skip_batches,
            iteration=iteration,
            **kwargs,
        )
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator

    def __iter__(self):
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        try:
            self.set_epoch(self.iteration)
            self.remainder, self._last_global_rows = self._last_step()
            self._uneven_role = self._uneven_role_from_lengths()
            skip = self._skip_this_epoch()
            self._starting_epoch()
            yield from self._through_uneven_end(self._read_ahead(super().__iter__(), skip))
            self.iteration += 1
        finally:
            self.end()

    def _read_ahead(self, batches: Iterator, skip: int) -> Iterator:
        done = object()
        current = next(batches, done)
        index = 0
        while current is not done:
            # Placed before reading the next batch, so a non_blocking copy overlaps with the read.
            current = place_batch(current, self.device, self._non_blocking)
            position = self._position()
            following = next(batches, done)
            self.end_of_dataloader = following is done
            if index >= skip:
                self._record_position(position, self.end_of_dataloader)
                yield current
            index += 1
            current = following

    def __len__(self) -> int:
        return max(0, self._base_len() - self.skip_batches)

    def _uneven_role_from_lengths(self) -> str | None:
        """This process's side of the epoch's last step when the processes' batch counts differ, else None.

        Only a sharded batch sampler without even_batches makes them differ; a sampler without a length
        cannot tell, and is treated as even.
        """
        sampler, skipped = self._index_batch_sampler(), self.skip_batches
        while isinstance(sampler, SkipBatchSampler):
            skipped, sampler = skipped + sampler.skip_batches, sampler.batch_sampler
        if not isinstance(sampler, BatchSamplerShard) or sampler.even_batches:
            return None
        try:
            lengths = [max(0, length - skipped) for length in sampler.lengths()]
        except TypeError:
            return None
        return uneven_role(lengths[sampler.process_index], lengths)

    def _last_step(self) -> tuple[int, int | None]:
        """(remainder, gathered rows) of this process's last step, from the lengths alone; -1 if unknown."""
        try:
            return self._last_step_from_lengths()
        except TypeError:  # a dataset or sampler without a length
            return -1, None

    def _last_step_from_lengths(self) -> tuple[int, int | None]:
        if isinstance(self.dataset, IterableDatasetShard):
            return self._last_iterable_step(len(self.dataset.dataset), self.dataset.global_batch_size, True)
        if isinstance(self.dataset, IterableDataset):
            return self._last_iterable_step(len(self.dataset), self.batch_size, False)
        sampler = self._index_batch_sampler()
        while isinstance(sampler, SkipBatchSampler):
            sampler = sampler.batch_sampler
        if isinstance(sampler, BatchSamplerShard):
            split, processes = sampler.split_batches, sampler.num_processes
            batch = None if sampler.batch_size is None else sampler.batch_size * (1 if split else processes)
            evened = sampler.even_batches or sampler.drop_last
            return last_step_sizes(sampler_num_samples(sampler.batch_sampler), batch, len(sampler), evened)
        batch = getattr(sampler, "batch_size", None)
        return last_step_sizes(sampler_num_samples(sampler), batch, len(sampler), False)

    def _last_iterable_step(self, samples: int, batch: int | None, evened: bool) -> tuple[int, int | None]:
        if batch is None:
            return -1, None
        steps = samples // batch if self._drop_last else math.ceil(samples / batch)
        return last_step_sizes(samples, batch, steps, evened)

    @property
    def total_batch_size(self) -> int:
        """The samples of one step across all processes."""
        sampler = self._index_batch_sampler()
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.global_batch_size
        if sampler is None:
            return self.batch_size
        processes = 1 if getattr(sampler, "split_batches", False) else getattr(sampler, "num_processes", 1)
        return sampler.batch_size * processes

    def set_sampler(self, sampler) -> None:
        """Replaces the sampler of indices under the batch sampler."""
        target = self._index_batch_sampler()
        while isinstance(target, (BatchSamplerShard, SkipBatchSampler)):
            target = target.batch_sampler
        target.sampler = sampler
