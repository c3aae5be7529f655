"""Sharded dataloaders, `prepare_data_loader`, `skip_first_batches` and the truncation behind `gather_for_metrics`.

Both dataloader classes are `torch.utils.data.DataLoader` subclasses (len, batch_size, dataset, sampler keep
their meaning) that register with `GradientState` while they are iterated and know, before yielding it, whether
a batch is the last one (`end_of_dataloader`) and how many real samples the last global batch holds
(`remainder`).

- `DataLoaderShard`: every process reads its own share (`BatchSamplerShard` / `IterableDatasetShard`).
- `DataLoaderDispatcher`: process 0 reads whole global batches and broadcasts them; each process keeps its slice.

In both, at every step the batches of processes 0..N-1, concatenated in that order, are the next samples of the
epoch in order; only the last step may add copies (to even out the batches), and they come after the real samples.
So `gather` + `gather_for_metrics_truncation` returns every sample exactly once, in order.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import itertools
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, IterDataPipe, RandomSampler

from accel import pytree
from accel.collectives import uneven
from accel.data.rng import multi_process, synchronize_rng_states
from accel.data.samplers import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    sampler_num_samples,
)
from accel.state import GradientState, PartialState

__all__ = [
    "DataLoaderAdapter",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "SkipDataLoader",
    "gather_for_metrics_truncation",
    "get_sampler",
    "override_even_batches",
    "prepare_data_loader",
    "skip_first_batches",
]

# The DataLoader arguments a prepared loader copies from the original (the sampling ones are rebuilt).
_COPIED_KWARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                  "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def _copied_kwargs(dataloader: DataLoader) -> dict:
    return {name: getattr(dataloader, name) for name in _COPIED_KWARGS if hasattr(dataloader, name)}


def _to_device(batch: Any, device: torch.device | None, non_blocking: bool) -> Any:
    """`batch` on `device` as HF's loaders place it (`send_to_device`); None leaves it where collate put it."""
    return batch if device is None else pytree.send_to_device(batch, device, non_blocking=non_blocking)


def _last_step_sizes(samples: int | None, batch: int | None, steps: int, evened: bool) -> tuple[int, int | None]:
    """(real samples, gathered rows) of the global batch at step `steps - 1`, for global batches of `batch`.

    Every global batch before the last one is full; `evened` means the last one is completed to `batch` rows.
    """
    if samples is None or batch is None:
        return -1, None
    if steps == 0:
        return 0, 0
    real = max(0, min(samples - (steps - 1) * batch, batch))
    return real, batch if evened else real


_HAS_LAST_STEP, _STANDS_BY = "has the last step", "stands by"


def _uneven_role(mine: int, counts: list[int]) -> str | None:
    """This process's side of the last step, given every process's count of batches (or of last-step parts).

    None when the counts agree, or without a process group (a loader sharded by hand, for one process).
    """
    if min(counts) == max(counts) or not multi_process():
        return None
    return _HAS_LAST_STEP if mine == max(counts) else _STANDS_BY


class DataLoaderStateMixin:
    """What a prepared dataloader tells `GradientState` while it is iterated.

    Attributes:
        end_of_dataloader: True while the last batch of this process is being used (set before it is yielded).
        remainder: The number of real samples in the global batch of this process's last step (-1 when unknown).
            At the end of the loader, gathering a per-sample tensor gives `remainder` real samples first, then
            copies added to even out the batches.
    """

    end_of_dataloader = False
    remainder = -1
    _last_global_rows = None  # rows `gather` returns at the last step; truncation only touches leaves this long
    # Without even_batches some processes may have no batch in the last step (see accel.collectives.uneven):
    # _uneven_role says which side this process is on (None when every process has the same number of batches).
    _uneven_role: str | None = None
    in_uneven_step = False  # True while this process uses its batch of such a last step
    # Set by Accelerator.join_uneven_inputs: torch's Join handles the processes whose data ran out (their loop
    # simply ends and Join shadows the others' DDP collectives), so this loader must not stand by for them.
    joined_by_torch = False

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1
        self._last_global_rows = None
        self._uneven_role = None

    def begin(self) -> None:
        """Resets the state and registers with `GradientState` (innermost dataloader)."""
        self.reset()
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """Unregisters from `GradientState`."""
        self.gradient_state._remove_dataloader(self)

    def _through_uneven_end(self, batches: Iterator) -> Iterator:
        """Yields `batches`; at the end of an uneven epoch, runs this process's side of the last step."""
        if self.joined_by_torch:
            yield from batches
            return
        for batch in batches:
            if self.end_of_dataloader and self._uneven_role == _HAS_LAST_STEP:
                yield from self._uneven_step(batch)
            else:
                yield batch
        if self._uneven_role == _STANDS_BY:
            uneven.stand_by()

    def _uneven_step(self, batch: Any) -> Iterator:
        self.in_uneven_step = True
        try:
            yield batch
        finally:  # also when the loop breaks on this batch: the processes standing by must be released
            if self.in_uneven_step:  # (a failed collective of that step already released everyone)
                self.in_uneven_step = False
                uneven.finish()


def _set_epoch_everywhere(loader: DataLoader, epoch: int) -> None:
    """Calls `set_epoch` on every sampler in the loader's chain, and on its dataset, where they have it."""
    seen = set()
    pending = [loader.batch_sampler, loader.sampler]
    while pending:
        sampler = pending.pop()
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        pending += [getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)]
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


class DataLoaderAdapter(DataLoader, DataLoaderStateMixin):
    """What accel's prepared loaders share: GradientState, epochs, and the DataLoader arguments they keep.

    HF Accelerate's class of this name wraps a `DataLoader` (or torchdata's `StatefulDataLoader`) and pretends to
    be its class; accel's loaders simply are `DataLoader`s. `use_stateful_dataloader=True` makes any of them
    (`DataLoaderShard(..., use_stateful_dataloader=True)`, as in HF) its variant on torchdata's
    `StatefulDataLoader` (accel.data.stateful), whose `state_dict()` / `load_state_dict()` save and resume the
    position within an epoch.

    Args:
        dataset: The dataset.
        use_stateful_dataloader: Build the stateful variant (needs torchdata >= 0.8).
        _drop_last: The original loader's `drop_last`.
        _non_blocking: Copy batches to the device with `non_blocking=True`.
        skip_batches: Batches to skip at the start of each epoch.
        iteration: The epoch to start at.
        **kwargs: `torch.utils.data.DataLoader` arguments.
    """

    # True for the variants of accel.data.stateful (torchdata's StatefulDataLoader under them): save_state saves
    # their `state_dict()` (HF Accelerate's attribute of the same name, which its checkpointing reads too).
    use_stateful_dataloader = False

    def __new__(cls, *args, use_stateful_dataloader: bool = False, **kwargs):
        if use_stateful_dataloader and not cls.use_stateful_dataloader:
            cls = _stateful_variant(cls)
        return super().__new__(cls)

    def __init__(self, dataset, use_stateful_dataloader: bool = False, _drop_last: bool = False,
                 _non_blocking: bool = False, skip_batches: int = 0, iteration: int = 0, **kwargs):  # fmt: skip
        super().__init__(dataset, **kwargs)
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.skip_batches = skip_batches
        self.iteration = iteration

    @property
    def gradient_state(self) -> GradientState:
        """The `GradientState` singleton (looked up, not stored, so that the loader pickles)."""
        return GradientState()

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of this loader and of the samplers / dataset under it that have `set_epoch`."""
        self.iteration = epoch
        _set_epoch_everywhere(self, epoch)

    @property
    def base_dataloader(self) -> DataLoader:
        """This loader itself (HF Accelerate's prepared loaders wrap one; code that reads it keeps working)."""
        return self

    def _base_len(self) -> int:
        return DataLoader.__len__(self)

    def _index_batch_sampler(self):
        """The batch sampler that yields this loader's index batches (None for an iterable dataset)."""
        if isinstance(self.dataset, IterableDataset):
            return None
        return self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler

    def get_sampler(self):
        """The sampler of indices under the batch sampler."""
        return get_sampler(self)

    # Hooks of the stateful variants (accel.data.stateful), which save the position of the batch in use:

    def _starting_epoch(self) -> None:
        """Called just before the wrapped loader starts an epoch (after the RNG synchronization and `set_epoch`;
        on process 0 only for a dispatcher): the stateful loaders note the sampler's generator state there."""

    def _position(self) -> Any:
        """The wrapped loader's position, asked right after a batch is read (before any read-ahead)."""
        return None

    def _skip_this_epoch(self) -> int:
        """The batches the epoch starting now skips (asked once per epoch on every process; a stateful loader
        resumed within an epoch has skipped them already)."""
        return self.skip_batches

    def _record_position(self, position: Any, finished: bool) -> None:
        """Called when the batch read at `position` becomes the one in use; `finished`: it is the epoch's last."""

    @property
    def total_dataset_length(self) -> int:
        """The length of the whole dataset (of the wrapped one for an `IterableDatasetShard`)."""
        return getattr(self.dataset, "total_length", None) or len(self.dataset)


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

    def __init__(self, dataset, device=None, rng_types=None, synchronized_generator=None, skip_batches: int = 0,
                 _drop_last: bool = False, _non_blocking: bool = False, iteration: int = 0, **kwargs):
        super().__init__(dataset, _drop_last=_drop_last, _non_blocking=_non_blocking, skip_batches=skip_batches,
                         iteration=iteration, **kwargs)
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
            current = _to_device(current, self.device, self._non_blocking)
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
        return _uneven_role(lengths[sampler.process_index], lengths)

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
            return _last_step_sizes(sampler_num_samples(sampler.batch_sampler), batch, len(sampler), evened)
        batch = getattr(sampler, "batch_size", None)
        return _last_step_sizes(sampler_num_samples(sampler), batch, len(sampler), False)

    def _last_iterable_step(self, samples: int, batch: int | None, evened: bool) -> tuple[int, int | None]:
        if batch is None:
            return -1, None
        steps = samples // batch if self._drop_last else math.ceil(samples / batch)
        return _last_step_sizes(samples, batch, steps, evened)

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


# --- DataLoaderDispatcher -----------------------------------------------------------------------------------------


def _comm_device() -> torch.device:
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _with_last_flag(items: Iterator) -> Iterator[tuple[Any, bool]]:
    """(item, is_last) for each item, reading one ahead."""
    done = object()
    current = next(items, done)
    while current is not done:
        following = next(items, done)
        yield current, following is done
        current = following


def take_rows(data: Any, count: int) -> Any:
    """`count` rows of `data`, cycling over its rows (`data` needs at least one)."""
    def cycle(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        index = torch.arange(count, device=tensor.device) % tensor.shape[0]
        return tensor.index_select(0, index)

    return pytree.recursively_apply(cycle, data)


# The packed batch travels in one tensor broadcast; its structure (with TensorSpecs) in one object broadcast.
_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of a packed batch lies in the byte buffer."""

    shape: tuple
    dtype: torch.dtype
    offset: int
    nbytes: int


def pack(data: Any) -> tuple[Any, torch.Tensor]:
    """(structure, buffer): `data` with its tensors replaced by `TensorSpec`s, and their bytes in one uint8 tensor."""
    pieces, offset = [], 0

    def spec(tensor: torch.Tensor) -> TensorSpec:
        nonlocal offset
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        start = offset
        padding = -raw.numel() % _ALIGNMENT  # keeps every offset a multiple of any dtype's size, for `view`
        pieces.extend([raw, torch.zeros(padding, dtype=torch.uint8)])
        offset += raw.numel() + padding
        return TensorSpec(tuple(tensor.shape), tensor.dtype, start, raw.numel())

    structure = pytree.recursively_apply(spec, data)
    buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return structure, buffer


def unpack(structure: Any, buffer: torch.Tensor) -> Any:
    """The batch `pack` packed: tensors are views of `buffer`, on its device."""
    def tensor(spec: TensorSpec) -> torch.Tensor:
        raw = buffer[spec.offset:spec.offset + spec.nbytes]
        return raw.view(spec.dtype).reshape(spec.shape)

    return pytree.recursively_apply(tensor, structure, test_type=lambda leaf: isinstance(leaf, TensorSpec))


class _GlobalBatch:
    """One global batch as every process sees it after the broadcast.

    `position` is what the (stateful) loader of process 0 reported right after reading it (None otherwise).
    """

    def __init__(self, data: Any, rows: int, last: bool, position: Any = None):
        self.data, self.rows, self.last, self.position = data, rows, last, position


@dataclasses.dataclass(frozen=True)
class _LoaderFailed:
    """Sent instead of a batch when process 0's loader raised, so the other processes raise too, not wait."""

    reason: str


class DataLoaderDispatcher(DataLoaderAdapter):
    """A `DataLoader` that only process 0 reads; each global batch is broadcast and every process keeps its slice.

    A global batch is one batch of the wrapped loader with `split_batches`, else `num_processes` consecutive
    batches joined. Process `r` keeps rows `[r*s, (r+1)*s)` with `s = rows / num_processes`. When the rows do
    not divide evenly, the slices differ by at most one row, except on the last global batch with
    `even_batches` (the default), which is completed by repeating its own first rows so that every process gets
    `ceil(rows / num_processes)` rows (HF Accelerate repeats the epoch's first rows; repeating the last batch's
    makes a resumed epoch, see `skip_first_batches`, yield exactly the same batches); without `even_batches`
    a process whose slice of the last batch is empty gets one batch fewer. The batch travels as one byte buffer
    (one object broadcast for its structure, one tensor broadcast for its data).

    Args:
        dataset: The dataset (not sharded: process 0 reads all of it).
        split_batches: Split each batch of the wrapped loader instead of joining `num_processes` of them.
        skip_batches: Global batches to skip at the start of each epoch.
        even_batches: Complete the last global batch so that every process gets the same number of rows.
        device: Where the slices go (default: this process's device).
        slice_fn: `slice_fn(batch, slice, process_index=, num_processes=)` cuts a process's rows
            (default: `slice_tensors`).
        _drop_last: The original loader's `drop_last` (a last incomplete group of batches is dropped).
        _non_blocking: Copy to `device` with `non_blocking=True`.
        iteration: The epoch to start at.
        **kwargs: `torch.utils.data.DataLoader` arguments.
    """

    def __init__(self, dataset, split_batches: bool = False, skip_batches: int = 0, even_batches: bool = True,
                 device=None, slice_fn: Callable | None = None, _drop_last: bool = False,
                 _non_blocking: bool = False, iteration: int = 0, **kwargs):
        super().__init__(dataset, _drop_last=_drop_last, _non_blocking=_non_blocking, skip_batches=skip_batches,
                         iteration=iteration, **kwargs)
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.device = device if device is not None else PartialState().device
        self.slice_fn = slice_fn if slice_fn is not None else pytree.slice_tensors

    @property
    def state(self) -> PartialState:
        """The `PartialState` singleton."""
        return PartialState()

    def __iter__(self):
        self.begin()
        try:
            self.set_epoch(self.iteration)
            source = None
            if self.state.process_index == 0:
                source = self._global_batches()
            elif isinstance(self.dataset, IterDataPipe):
                DataLoader.__iter__(self)  # its iterator agrees on a shared seed with a collective on every rank
            yield from self._through_uneven_end(self._dispatch(source, self._skip_this_epoch()))
            self.iteration += 1
        finally:
            self.end()

    def _global_batches(self) -> Iterator[tuple[tuple[Any, Any], bool]]:
        """On process 0: ((global batch, position after it), is_last) pairs."""
        self._starting_epoch()
        loaded = super().__iter__()
        per_step = 1 if self.split_batches else self.state.num_processes
        groups = iter(lambda: list(itertools.islice(loaded, per_step)), [])
        if self._drop_last:
            groups = itertools.takewhile(lambda group: len(group) == per_step, groups)
        # The position is taken as soon as a group is read, before the look-ahead reads the next one; it travels
        # with the batch, so every process records process 0's (and the epoch's end is the global one).
        return _with_last_flag((self._join(group), self._position()) for group in groups)

    @staticmethod
    def _join(group: list) -> Any:
        if len(group) == 1:
            return group[0]
        try:
            return pytree.concatenate_batches(group)
        except RuntimeError as error:
            raise RuntimeError(
                "dispatch_batches=True joins num_processes batches into one, which needs batches whose tensors "
                "have the same shape apart from dim 0. Pad them to a common shape in collate_fn, use "
                "split_batches=True (the main process splits each batch), or dispatch_batches=False."
            ) from error

    def _dispatch(self, source, skip: int) -> Iterator:
        current = self._receive(source)
        index = 0
        while current is not None:
            following = None if current.last else self._receive(source)
            part = self._part(current)
            if current.last and index >= skip:
                self._uneven_role = self._uneven_role_at(current)
            if following is None or self._part_bounds(following)[1] is None:
                self.end_of_dataloader = True
                self.remainder = current.rows
                self._last_global_rows = self._gathered_rows(current)
            if index >= skip:  # (also where this process has no part of the batch)
                self._record_position(current.position, current.last)
            if part is not None and index >= skip:
                yield _to_device(part, self.device, self._non_blocking)
            index += 1
            current = following

    def _receive(self, source) -> _GlobalBatch | None:
        """The next global batch on every process (None when the loader is exhausted): a collective."""
        message = [None]
        buffer = None
        failure = None
        if source is not None:
            try:
                item = next(source, None)
            except Exception as error:  # noqa: BLE001 - every process must hear of it, then it is re-raised
                failure, item = error, None
                message = [_LoaderFailed(f"{type(error).__name__}: {error}")]
            if item is not None:
                (batch, position), last = item
                structure, buffer = pack(batch)
                message = [(structure, buffer.numel(), pytree.batch_rows(batch), last, position)]
        if multi_process():
            dist.broadcast_object_list(message, src=0, device=_comm_device())
        if isinstance(message[0], _LoaderFailed):
            if failure is not None:
                raise failure
            raise RuntimeError(f"the main process's dataloader raised {message[0].reason} (see its traceback)")
        if message[0] is None:
            return None
        structure, nbytes, rows, last, position = message[0]
        if multi_process():
            device = _comm_device()
            buffer = buffer.to(device) if buffer is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
            if nbytes:
                dist.broadcast(buffer, 0)
        return _GlobalBatch(unpack(structure, buffer), rows, last, position)

    def _evened(self, batch: _GlobalBatch) -> bool:
        return batch.last and self.even_batches and batch.rows % self.state.num_processes != 0

    def _gathered_rows(self, batch: _GlobalBatch) -> int:
        processes = self.state.num_processes
        return math.ceil(batch.rows / processes) * processes if self._evened(batch) else batch.rows

    def _uneven_role_at(self, last: _GlobalBatch) -> str | None:
        """This process's side of the last step: without even_batches, some processes may get no rows of it."""
        parts = [self._part_bounds(last, rank)[1] is not None for rank in range(self.state.num_processes)]
        return _uneven_role(int(parts[self.state.process_index]), [int(part) for part in parts])

    def _part_bounds(self, batch: _GlobalBatch, rank: int | None = None) -> tuple[int, int | None]:
        """[start, end) of process `rank`'s rows (default: this one's); end is None when it gets nothing from the
        last batch."""
        processes = self.state.num_processes
        rank = self.state.process_index if rank is None else rank
        if self._evened(batch):
            size = math.ceil(batch.rows / processes)
            return rank * size, (rank + 1) * size
        size, extra = divmod(batch.rows, processes)
        start = rank * size + min(rank, extra)
        end = start + size + (1 if rank < extra else 0)
        return start, None if batch.last and end == start and batch.rows > 0 else end

    def _part(self, batch: _GlobalBatch) -> Any:
        start, end = self._part_bounds(batch)
        if end is None:
            return None
        data = batch.data
        if self._evened(batch):
            padding = self._gathered_rows(batch) - batch.rows
            data = pytree.concatenate_batches([data, take_rows(data, padding)])
        return self.slice_fn(data, slice(start, end), process_index=self.state.process_index,
                             num_processes=self.state.num_processes)

    def __len__(self) -> int:
        processes, rank = self.state.num_processes, self.state.process_index
        per_step = 1 if self.split_batches else processes
        sampler, skipped = self._index_batch_sampler(), 0
        while isinstance(sampler, SkipBatchSampler):  # count the epoch's steps, then take the skipped ones off
            skipped, sampler = skipped + sampler.skip_batches, sampler.batch_sampler
        whole = self._base_len() if sampler is None else len(sampler)
        steps = whole // per_step if self._drop_last else math.ceil(whole / per_step)
        if not self.even_batches and steps > 0:
            batch = self._base_batch_size()
            last = _last_step_sizes(self._sample_count(), batch * per_step if batch else None, steps, False)[0]
            steps -= 1 if 0 <= last < processes and rank >= last else 0
        return max(0, steps - skipped // per_step - self.skip_batches)

    def _base_batch_size(self) -> int | None:
        sampler = self._index_batch_sampler()
        return self.batch_size if sampler is None else getattr(sampler, "batch_size", None)

    def _sample_count(self) -> int | None:
        sampler = self._index_batch_sampler()
        if sampler is not None:
            return sampler_num_samples(sampler)
        try:
            return len(self.dataset)
        except TypeError:
            return None

    @property
    def total_batch_size(self) -> int:
        """The samples of one step across all processes."""
        return self._base_batch_size() * (1 if self.split_batches else self.state.num_processes)

    def set_sampler(self, sampler) -> None:
        """Replaces the sampler of indices under the batch sampler."""
        target = self._index_batch_sampler()
        while isinstance(target, SkipBatchSampler):
            target = target.batch_sampler
        target.sampler = sampler


# --- join_uneven_inputs -------------------------------------------------------------------------------------------


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
        import warnings

        warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some dataloaders given "
                      "were iterable")  # fmt: skip
    saved = [(owner, owner.even_batches) for owner in owners if owner is not None]
    for owner, _ in saved:
        owner.even_batches = even_batches

    def restore() -> None:
        for owner, value in saved:
            owner.even_batches = value

    return restore


# --- prepare_data_loader ------------------------------------------------------------------------------------------


def get_sampler(dataloader: DataLoader):
    """The sampler of indices of `dataloader` (under its batch sampler), or None."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def _with_sampler(batch_sampler, sampler):
    """A copy of `batch_sampler` drawing from `sampler` (the user's batch sampler is left as it is)."""
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    replaced = copy.copy(batch_sampler)
    replaced.sampler = sampler
    return replaced


def _shared_seed(data_seed: int | None) -> int:
    """`data_seed`, else process 0's `torch.initial_seed()` on every process (so all shuffle alike)."""
    if data_seed is not None:
        return data_seed
    seed = [torch.initial_seed()]
    if multi_process():
        dist.broadcast_object_list(seed, src=0, device=_comm_device())
    return seed[0]


def _seedable(sampler: RandomSampler, data_seed: int | None) -> SeedableRandomSampler:
    return SeedableRandomSampler(
        data_source=sampler.data_source,
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        generator=sampler.generator,
        data_seed=_shared_seed(data_seed),
    )


def _synchronized_generator(sampler) -> torch.Generator | None:
    """The sampler's generator, given one seeded from the global torch RNG when it has none (as HF does)."""
    if not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None:
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    return sampler.generator


def _check_split_batches(dataloader: DataLoader, num_processes: int) -> None:
    batch_size = dataloader.batch_size
    if batch_size is None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None:
        raise ValueError(
            "split_batches=True needs a `batch_size` attribute on the dataloader or its batch_sampler; both are "
            f"None (batch_sampler is a {type(dataloader.batch_sampler).__name__})."
        )
    if num_processes > 1 and batch_size % num_processes != 0:
        raise ValueError(
            f"To use a `DataLoader` in `split_batches` mode, the batch size ({batch_size}) needs to be a round "
            f"multiple of the number of processes ({num_processes})."
        )


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh=None,
) -> DataLoader:
    """Wraps `dataloader` so that this process gets its share of every batch (HF Accelerate's semantics).

    The user's dataloader and its samplers are not modified, except that a `RandomSampler` without a
    generator gets one (seeded from the torch RNG), which `rng_types=["generator"]` then keeps identical
    across processes.

    Args:
        dataloader: The loader to shard.
        device: Where to put the batches (with `put_on_device`; the dispatcher defaults to this process's device).
        num_processes: The number of processes (default: `PartialState().num_processes`).
        process_index: This process's index (default: `PartialState().process_index`).
        split_batches: Split each batch across the processes (the batch size must be a multiple of
            `num_processes`) instead of giving each process whole batches.
        put_on_device: Move the batches to `device`.
        rng_types: Generators to synchronize at each epoch start: "torch", "cuda", "generator".
        dispatch_batches: Process 0 reads and broadcasts (default: True for an `IterableDataset` when
            `put_on_device`, else False). Needs `put_on_device`.
        even_batches: Complete the last batches with samples from the start so all processes get the same number.
        slice_fn_for_dispatch: How the dispatcher cuts each process's rows (default: `slice_tensors`).
        use_seedable_sampler: Replace a `RandomSampler` with a `SeedableRandomSampler` (same order on every
            process and epoch-reproducible; pair with `set_epoch`).
        non_blocking: Copy batches to the device with `non_blocking=True` (useful with `pin_memory`).
        data_seed: The seed of the `SeedableRandomSampler` (default: process 0's `torch.initial_seed()`).
        use_stateful_dataloader: Build the loader on torchdata's `StatefulDataLoader` (needs `torchdata`):
            `state_dict()` / `load_state_dict()` then save and resume the position within an epoch (with
            `dispatch_batches`, process 0's position, which every process reports).
        torch_device_mesh: Device meshes (tensor/context parallelism) are refused (UnsupportedFeatureError).

    Returns:
        A `DataLoaderShard` or a `DataLoaderDispatcher` (their `StatefulDataLoader` variants with
        `use_stateful_dataloader`).

    Example:
        ```python
        loader = DataLoader(range(8), batch_size=2)
        prepared = prepare_data_loader(loader, num_processes=2, process_index=0)
        list(prepared)  # rank 0: [tensor([0, 1]), tensor([4, 5])]   rank 1: [tensor([2, 3]), tensor([6, 7])]
        ```
    """
    if torch_device_mesh is not None:
        from accel.backends import DDP_INSTEAD
        from accel.unsupported import refuse

        raise refuse("tensor/context parallelism", "prepare_data_loader(torch_device_mesh=...)", DDP_INSTEAD)
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("Using `dispatch_batches=True` requires `put_on_device=True`.")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    if split_batches:
        _check_split_batches(dataloader, num_processes)
    rng_types = list(rng_types) if rng_types is not None else None
    dataset = dataloader.dataset
    batch_sampler = None if isinstance(dataset, IterableDataset) else (
        dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler)
    sampler = get_sampler(dataloader)
    if batch_sampler is not None and use_seedable_sampler and isinstance(sampler, RandomSampler):
        sampler = _seedable(sampler, data_seed)
        batch_sampler = _with_sampler(batch_sampler, sampler)
    if use_stateful_dataloader and not isinstance(sampler, SeedableRandomSampler):
        _synchronized_generator(sampler)  # a stateful loader saves the state of the generator its order comes from
    kwargs = _copied_kwargs(dataloader)
    kwargs["use_stateful_dataloader"] = use_stateful_dataloader
    if dispatch_batches:
        return _dispatcher(dataloader, batch_sampler, split_batches, even_batches, device, slice_fn_for_dispatch,
                           non_blocking, kwargs)
    dataset, batch_sampler, synchronized_generator = _shard(dataset, batch_sampler, sampler, dataloader,
                                                            num_processes, process_index, split_batches,
                                                            even_batches)
    if rng_types is not None and synchronized_generator is None and "generator" in rng_types:
        rng_types.remove("generator")
    common = dict(device=device if put_on_device else None, rng_types=rng_types,
                  synchronized_generator=synchronized_generator, _drop_last=dataloader.drop_last,
                  _non_blocking=non_blocking, **kwargs)
    if batch_sampler is None:
        batch_size = dataloader.batch_size
        if split_batches and num_processes > 1:
            batch_size //= num_processes
        return DataLoaderShard(dataset, batch_size=batch_size, drop_last=dataloader.drop_last, **common)
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoaderShard(dataset, sampler=batch_sampler, batch_size=dataloader.batch_size, **common)
    return DataLoaderShard(dataset, batch_sampler=batch_sampler, **common)


def _stateful_variant(cls: type) -> type:
    """`cls` on torchdata's StatefulDataLoader (accel.data.stateful imports torchdata, so only when asked for)."""
    try:
        stateful = importlib.import_module("accel.data.stateful")
    except ImportError as error:
        raise ImportError("use_stateful_dataloader=True needs torchdata's StatefulDataLoader (torchdata >= 0.8: "
                          f"pip install torchdata): {error}") from error
    return stateful.stateful_variant(cls)


def _shard(dataset, batch_sampler, sampler, dataloader, num_processes, process_index, split_batches, even_batches):
    """(dataset, batch sampler, generator to keep synchronized) of this process."""
    if num_processes == 1:
        return dataset, batch_sampler, None
    if isinstance(dataset, IterableDataset):
        shard = IterableDatasetShard(dataset, dataloader.batch_size, dataloader.drop_last, num_processes,
                                     process_index, split_batches)
        return shard, None, getattr(dataset, "generator", None)
    generator = None if isinstance(sampler, SeedableRandomSampler) else _synchronized_generator(sampler)
    shard = BatchSamplerShard(batch_sampler, num_processes, process_index, split_batches, even_batches)
    return dataset, shard, generator


def _dispatcher(dataloader, batch_sampler, split_batches, even_batches, device, slice_fn, non_blocking, kwargs):
    common = dict(split_batches=split_batches, even_batches=even_batches, device=device, slice_fn=slice_fn,
                  _drop_last=dataloader.drop_last, _non_blocking=non_blocking, **kwargs)
    if batch_sampler is None:
        return DataLoaderDispatcher(dataloader.dataset, batch_size=dataloader.batch_size,
                                    drop_last=dataloader.drop_last, **common)
    return DataLoaderDispatcher(dataloader.dataset, batch_sampler=batch_sampler, **common)


# --- skip_first_batches -------------------------------------------------------------------------------------------


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
        super().__init__(dataset, skip_batches=skip_batches, use_stateful_dataloader=use_stateful_dataloader,
                         **kwargs)  # fmt: skip


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
    kwargs = _copied_kwargs(dataloader)
    if isinstance(dataloader, DataLoaderShard):
        kwargs.update(device=dataloader.device, rng_types=dataloader.rng_types,
                      synchronized_generator=dataloader.synchronized_generator, _drop_last=dataloader._drop_last,
                      _non_blocking=dataloader._non_blocking, iteration=dataloader.iteration)
    else:
        kwargs.update(_drop_last=dataloader.drop_last)
    if isinstance(dataloader.dataset, IterableDataset):
        skipping = DataLoaderShard if isinstance(dataloader, DataLoaderShard) else SkipDataLoader
        return skipping(dataloader.dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last,
                        skip_batches=num_batches, **kwargs)
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
    kwargs = _copied_kwargs(dataloader)
    kwargs.update(split_batches=dataloader.split_batches, even_batches=dataloader.even_batches,
                  device=dataloader.device, slice_fn=dataloader.slice_fn, _drop_last=dataloader._drop_last,
                  _non_blocking=dataloader._non_blocking, iteration=dataloader.iteration)
    sampler = dataloader._index_batch_sampler()
    if sampler is None:
        return DataLoaderDispatcher(dataloader.dataset, batch_size=dataloader.batch_size,
                                    drop_last=dataloader.drop_last, skip_batches=num_batches, **kwargs)
    # A global batch joins num_processes batches of the wrapped sampler unless they are split.
    per_step = 1 if dataloader.split_batches else dataloader.state.num_processes
    skipped = SkipBatchSampler(sampler, num_batches * per_step)
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoaderDispatcher(dataloader.dataset, sampler=skipped, batch_size=dataloader.batch_size, **kwargs)
    return DataLoaderDispatcher(dataloader.dataset, batch_sampler=skipped, **kwargs)


# --- gather_for_metrics -------------------------------------------------------------------------------------------


def gather_for_metrics_truncation(gathered: Any, gradient_state: GradientState | None = None,
                                  use_gather_object: bool = False) -> Any:
    """Drops the copies that evened-out last batches added to data already gathered across processes.

    Contract: `gathered` is what `gather` (or `gather_object`) returned for per-sample data of the current
    batch of the active prepared dataloader: every leaf's dim 0 is the processes' batches concatenated in rank
    order. Outside the last batch this returns `gathered` unchanged. At the last batch
    (`gradient_state.end_of_dataloader`), each tensor leaf whose dim 0 has the length the gathered batch has
    at that step is cut to its first `gradient_state.remainder` rows (the real samples; the copies always come
    after them); other leaves (a gathered per-process loss, non-tensors) are returned unchanged, and so is
    everything when the remainder is unknown (-1: an iterable dataset without a length). Sharding never
    reorders samples, so over a full pass the results are every sample exactly once, in order.

    Args:
        gathered: A tensor or a pytree (dict, list, tuple, named tuple) of tensors; with `use_gather_object`,
            the list of per-sample objects `gather_object` returned.
        gradient_state: The state to read (default: the `GradientState` singleton).
        use_gather_object: `gathered` is a flat list of per-sample objects: cut the list itself.

    Example:
        ```python
        # 7 samples, batch_size=2, 2 processes: the last step gathers [4, 5, 6, 0]
        for batch in prepared_loader:
            preds = gather_for_metrics_truncation(gather(model(batch)))  # last step: [4, 5, 6]
        ```
    """
    state = gradient_state if gradient_state is not None else GradientState()
    if not state.end_of_dataloader or state.remainder < 0:
        return gathered
    remainder = state.remainder
    rows = getattr(state.active_dataloader, "_last_global_rows", None)

    def cut(values):
        if rows is not None and len(values) != rows:
            return values
        return values[:remainder]

    if use_gather_object:
        return cut(gathered)
    return pytree.recursively_apply(lambda tensor: cut(tensor) if tensor.dim() > 0 else tensor, gathered)
