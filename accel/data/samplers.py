"""Samplers that give each process its share of a dataset, with HF Accelerate's semantics.

Sharding never reorders data: at every step, the batches of process 0, 1, ..., N-1 concatenated in that order
are the next `total_batch_size` samples of the unsharded sampler (followed, on the last step only, by samples
from the start of the epoch when `even_batches` has to complete the last batches). That invariant is what lets
`gather_for_metrics` return each sample exactly once, in order.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Iterator

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler

__all__ = ["BatchSamplerShard", "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler"]


def _check_split(batch_size: int | None, num_processes: int, owner: str) -> None:
    if batch_size is None or batch_size % num_processes != 0:
        raise ValueError(
            f"To use `{owner}` in `split_batches` mode, the batch size ({batch_size}) needs to be a round multiple "
            f"of the number of processes ({num_processes})."
        )


def sampler_num_samples(batch_sampler) -> int | None:
    """How many indices an unsharded batch sampler yields in one epoch (before `drop_last`), or None if unknown."""
    sampler = getattr(batch_sampler, "sampler", None)
    try:
        return len(sampler)
    except TypeError:
        return None


class SeedableRandomSampler(RandomSampler):
    """A `RandomSampler` whose permutation depends only on `initial_seed + epoch`, so every process draws the same.

    Args:
        *args, **kwargs: As `torch.utils.data.RandomSampler`.
        data_seed: The seed of epoch 0; None uses `torch.initial_seed()` (the seed `set_seed` gave).

    Example:
        ```python
        sampler = SeedableRandomSampler(range(8), data_seed=42)
        sampler.set_epoch(3)
        order = list(sampler)  # the same list on rank 0 and rank 1; epoch 4 next time
        ```
    """

    def __init__(self, *args, data_seed: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next iteration shuffles for."""
        self.epoch = epoch


class BatchSamplerShard(BatchSampler):
    """Wraps a batch sampler so that it yields the batches of process `process_index` only.

    Without `split_batches`, process `r` takes batches `r, r + N, r + 2N, ...` (N = `num_processes`); with it,
    each batch is cut into N equal slices and process `r` takes slice `r`. With `even_batches` (the default) the
    last batches are completed with indices from the start of the epoch so that every process gets the same
    number of full batches; otherwise processes may get one batch fewer (and the last one may be short). When
    the wrapped sampler drops its last incomplete batch (`drop_last`), batches that would not be present on every
    process are dropped too.

    Args:
        batch_sampler: The batch sampler to shard (`batch_size=None` means batches of varying sizes; they need
            `even_batches=False` or are completed with whole batches from the start).
        num_processes: The number of processes.
        process_index: This process's index.
        split_batches: Split each batch across the processes instead of dealing out whole batches.
        even_batches: Loop back to the start to give every process the same number of full batches.

    Example:
        ```python
        # sampler batches [[0, 1, 2, 3], [4, 5, 6, 7]] on 2 processes
        BatchSamplerShard(bs, 2, 0)  # rank 0: [0, 1, 2, 3]          rank 1: [4, 5, 6, 7]
        BatchSamplerShard(bs, 2, 0, split_batches=True)  # rank 0: [0, 1], [4, 5]   rank 1: [2, 3], [6, 7]
        ```
    """

    def __init__(
        self,
        batch_sampler,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches:
            _check_split(self.batch_size, num_processes, "BatchSamplerShard")

    @property
    def sampler(self):
        """The sampler of indices under the wrapped batch sampler (None if it has none)."""
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        """The number of batches of the wrapped sampler."""
        return len(self.batch_sampler)

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        if self.split_batches:
            return batches - (0 if self._gets_last_split_batch(batches) else 1)
        full_rounds, extra = divmod(batches, self.num_processes)
        if extra == 0 or self.drop_last:
            return full_rounds
        return full_rounds + (1 if self.even_batches or self.process_index < extra else 0)

    def lengths(self) -> list[int]:
        """The number of batches of every process, in process order (they differ only without even_batches)."""
        return [len(self._as_process(rank)) for rank in range(self.num_processes)]

    def _as_process(self, rank: int) -> BatchSamplerShard:
        other = copy.copy(self)
        other.process_index = rank
        return other

    def _gets_last_split_batch(self, batches: int) -> bool:
        """Whether this process gets a slice of the last batch (always, except without even_batches)."""
        if batches == 0 or self.even_batches or self.drop_last:
            return True
        samples = sampler_num_samples(self.batch_sampler)
        if samples is None:
            return True
        last = samples - (batches - 1) * self.batch_size
        return last > self.process_index * (self.batch_size // self.num_processes)

    def __iter__(self) -> Iterator[list]:
        return self._iter_split() if self.split_batches else self._iter_whole()

    def _iter_split(self) -> Iterator[list]:
        size = self.batch_size // self.num_processes
        start, end = self.process_index * size, (self.process_index + 1) * size
        first = None
        batch = []
        for batch in self.batch_sampler:
            first = list(batch) if first is None else first
            if len(batch) == self.batch_size:
                yield batch[start:end]
        if self.drop_last or not batch or len(batch) == self.batch_size:
            return
        if not self.even_batches:
            if len(batch) > start:
                yield batch[start:end]
            return
        filler = itertools.cycle(first)
        yield (list(batch) + [next(filler) for _ in range(self.batch_size - len(batch))])[start:end]

    def _iter_whole(self) -> Iterator[list]:
        group, initial = [], []
        for index, batch in enumerate(self.batch_sampler):
            if index < self.num_processes and not self.drop_last:
                initial.append(batch)
            group.append(batch)
            if len(group) == self.num_processes and self._is_full(batch):
                yield group[self.process_index]
                group = []
        if self.drop_last or not group:
            return
        if not self.even_batches:
            if self.process_index < len(group):
                yield group[self.process_index]
            return
        yield self._complete(group, initial)[self.process_index]

    def _is_full(self, batch) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _complete(self, group: list, initial: list) -> list:
        """The last group of batches, completed to `num_processes` full batches from the epoch's first batches."""
        if self.batch_size is None:  # varying sizes: complete with whole batches
            filler = itertools.cycle(initial)
            return group + [next(filler) for _ in range(self.num_processes - len(group))]
        filler = itertools.cycle([index for batch in initial for index in batch])
        group = [*group[:-1], list(group[-1]) + [next(filler) for _ in range(self.batch_size - len(group[-1]))]]
        while len(group) < self.num_processes:
            group.append([next(filler) for _ in range(self.batch_size)])
        return group


class IterableDatasetShard(IterableDataset):
    """Wraps an `IterableDataset` so that it yields the samples of process `process_index` only.

    The dataset is read in global batches of `batch_size * num_processes` samples (`batch_size` with
    `split_batches`); process `r` takes the `r`-th slice of each. Without `drop_last`, the last global batch is
    completed with samples from the first one; with it, the last incomplete global batch is dropped.

    Args:
        dataset: The iterable dataset to shard.
        batch_size: The batch size per process, or the global batch size with `split_batches`.
        drop_last: Drop the last incomplete global batch instead of completing it.
        num_processes: The number of processes.
        process_index: This process's index.
        split_batches: `batch_size` is the global batch size, split across the processes.

    Example:
        ```python
        # dataset yields 0..7, batch_size=4, 2 processes
        IterableDatasetShard(ds, 4, num_processes=2, process_index=0)  # rank 0: 0 1 2 3   rank 1: 4 5 6 7
        IterableDatasetShard(ds, 4, num_processes=2, process_index=0, split_batches=True)
        # rank 0: 0 1 4 5   rank 1: 2 3 6 7
        ```
    """

    def __init__(
        self,
        dataset,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ):
        if split_batches and num_processes > 1:
            _check_split(batch_size, num_processes, "IterableDatasetShard")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0

    @property
    def global_batch_size(self) -> int:
        """The samples read per step across all processes."""
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def process_batch_size(self) -> int:
        """The samples each process takes from a global batch."""
        return self.global_batch_size // self.num_processes

    @property
    def total_length(self) -> int:
        """The length of the wrapped dataset (raises TypeError when it has none)."""
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, and forwards it to the wrapped dataset when it has `set_epoch`."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        rounds = len(self.dataset) / self.global_batch_size
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.process_batch_size

    def __iter__(self):
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        size = self.process_batch_size
        start, end = self.process_index * size, (self.process_index + 1) * size
        first, current = None, []
        for element in self.dataset:
            current.append(element)
            if len(current) == self.global_batch_size:
                yield from current[start:end]
                first = current if first is None else first
                current = []
        if self.drop_last or not current:
            return
        filler = itertools.cycle(first if first is not None else list(current))
        current += [next(filler) for _ in range(self.global_batch_size - len(current))]
        yield from current[start:end]


class SkipBatchSampler(BatchSampler):
    """A batch sampler that skips the first `skip_batches` batches of another one (to resume mid-epoch).

    Args:
        batch_sampler: The batch sampler to wrap.
        skip_batches: How many of its first batches to skip.
    """

    def __init__(self, batch_sampler, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __getattr__(self, name: str):
        # batch_size, drop_last, sampler, split_batches... read through to the wrapped sampler
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __iter__(self):
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        """The number of batches of the wrapped sampler."""
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)
