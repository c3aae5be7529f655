"""`DataLoaderDispatcher`: a prepared `DataLoader` that only process 0 reads; each global batch is broadcast and
every process keeps its slice. A batch travels packed (`pack` / `unpack`): its structure in one object
broadcast, its tensors' bytes in one tensor broadcast.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterDataPipe

from accel import pytree
from accel.data.loaders import DataLoaderAdapter, last_step_sizes, place_batch, uneven_role
from accel.data.rng import comm_device, multi_process
from accel.data.samplers import SkipBatchSampler, sampler_num_samples
from accel.state import PartialState
from accel.wire.byte_views import byte_view, dense_values

__all__ = ["DataLoaderDispatcher", "pack", "unpack"]


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
        raw = byte_view(dense_values(tensor.detach().cpu()))
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
        raw = buffer[spec.offset : spec.offset + spec.nbytes]
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

    def __init__(
        self,
        dataset,
        split_batches: bool = False,
        skip_batches: int = 0,
        even_batches: bool = True,
        device=None,
        slice_fn: Callable | None = None,
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
                yield place_batch(part, self.device, self._non_blocking)
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
            dist.broadcast_object_list(message, src=0, device=comm_device())
        if isinstance(message[0], _LoaderFailed):
            if failure is not None:
                raise failure
            raise RuntimeError(f"the main process's dataloader raised {message[0].reason} (see its traceback)")
        if message[0] is None:
            return None
        structure, nbytes, rows, last, position = message[0]
        if multi_process():
            device = comm_device()
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
        return uneven_role(int(parts[self.state.process_index]), [int(part) for part in parts])

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
        return self.slice_fn(
            data, slice(start, end), process_index=self.state.process_index, num_processes=self.state.num_processes
        )

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
            last = last_step_sizes(self._sample_count(), batch * per_step if batch else None, steps, False)[0]
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
