"""What every prepared dataloader shares: `DataLoaderAdapter` (a `DataLoader` registered with `GradientState`
while iterated, with epochs and the arguments it keeps), `DataLoaderStateMixin`, and `get_sampler`.

The loaders themselves: `accel.data.shard_loader` (`DataLoaderShard`, every process reads its share),
`accel.data.dispatcher` (`DataLoaderDispatcher`, process 0 reads and broadcasts), `accel.data.skip`
(`skip_first_batches`), built by `accel.data.prepare.prepare_data_loader`; their variants on torchdata's
`StatefulDataLoader` in `accel.data.stateful`.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from accel import pytree
from accel.data.rng import multi_process
from accel.gradient_state import GradientState
from accel.wire import uneven

__all__ = ["DataLoaderAdapter", "DataLoaderStateMixin", "get_sampler"]

# The DataLoader arguments a prepared loader copies from the original (the sampling ones are rebuilt).
_COPIED_KWARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def copied_kwargs(dataloader: DataLoader) -> dict:
    """The `DataLoader` arguments of `dataloader` that a prepared (or skipping) copy of it keeps."""
    return {name: getattr(dataloader, name) for name in _COPIED_KWARGS if hasattr(dataloader, name)}


def place_batch(batch: Any, device: torch.device | None, non_blocking: bool) -> Any:
    """`batch` on `device` as HF's loaders place it (`send_to_device`); None leaves it where collate put it."""
    return batch if device is None else pytree.send_to_device(batch, device, non_blocking=non_blocking)


def last_step_sizes(samples: int | None, batch: int | None, steps: int, evened: bool) -> tuple[int, int | None]:
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


def uneven_role(mine: int, counts: list[int]) -> str | None:
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
    # Without even_batches some processes may have no batch in the last step (see accel.wire.uneven):
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

    def __init__(
        self,
        dataset,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        skip_batches: int = 0,
        iteration: int = 0,
        **kwargs,
    ):
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


def get_sampler(dataloader: DataLoader):
    """The sampler of indices of `dataloader` (under its batch sampler), or None."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def _stateful_variant(cls: type) -> type:
    """`cls` on torchdata's StatefulDataLoader (accel.data.stateful imports torchdata, so only when asked for)."""
    try:
        # Imported (with torchdata) only when a stateful loader is asked for; by name, so that a module unloaded
        # to simulate torchdata's absence is imported again rather than taken from the package's attributes.
        stateful = importlib.import_module("accel.data.stateful")
    except ImportError as error:
        raise ImportError(
            "use_stateful_dataloader=True needs torchdata's StatefulDataLoader (torchdata >= 0.8: "
            f"pip install torchdata): {error}"
        ) from error
    return stateful.stateful_variant(cls)
