"""Prepared loaders on torchdata's `StatefulDataLoader`: they save and resume their position within an epoch.

(Imported only when `use_stateful_dataloader=True`: it needs torchdata.) A prepared loader reads ahead (to know
which batch is last), so the wrapped `StatefulDataLoader` is always further than the user. The position is
therefore snapshotted as each batch is read, before anything after it: `state_dict()` taken while a batch is in
use describes the position after that batch, and loading it resumes with the next one (after the last batch of
an epoch: with the next epoch). The loader's epoch count (`iteration`, which `set_epoch` uses) is part of the state,
and so is the state of the generator the sampler shuffles with (at the start of the epoch, or at its end for a
finished one; a shuffling sampler gets a generator at prepare time): torchdata resumes a sampler it cannot
checkpoint (accel's and HF's sharded ones) by replaying it, which only gives the same order from the same
generator state. (HF Accelerate saves neither: its shuffled resumes replay another order.)

`stateful_variant(cls)` makes, once per class, `Stateful<cls name>`: `cls` on `StatefulDataLoader` with
`_SavesPosition` first. `DataLoaderAdapter.__new__` asks for it when `use_stateful_dataloader=True`, so this module
needs none of the loader classes (it sits above torchdata, beside them):

- `StatefulDataLoaderShard`: every process reads its own share; its state is its own loader's position.
- `StatefulDataLoaderDispatcher`: only process 0 reads. Its position travels with every global batch in the
  message process 0 broadcasts anyway (no extra collective), so every process's `state_dict()` is process 0's
  position and a checkpoint written by the main process resumes every rank exactly. (HF Accelerate's
  dispatcher reports each process's own, never-read loader on the other ranks, and every rank writes the same
  `dl_state_dict.bin`: which one lands decides whether the resume is right.)
- `StatefulSkipDataLoader`: a `SkipDataLoader` that saves its position.
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

_FINISHED = "_iterator_finished"  # StatefulDataLoader's key: the epoch is over
_ITERATION = "_accel_iteration"  # ours: the epoch the state belongs to (ignored by StatefulDataLoader)
_GENERATOR = "_accel_sampler_generator"  # ours: the sampler generator's state the epoch resumed in starts from
_SKIP = "_accel_skip"  # ours: the batches still to skip (skip_batches) in the epoch resumed in


class _SavesPosition:
    """`state_dict()` / `load_state_dict()` of a prepared loader, from the positions its loop reports (the hooks
    `_starting_epoch`, `_position` and `_record_position` of `DataLoaderAdapter`)."""

    use_stateful_dataloader = True
    _snapshot: dict | None = None
    _epoch_generator = None  # the sampler generator's state when the current epoch started
    _resumed_skip: int | None = None  # the skip of the epoch a loaded state resumes in

    def _sampler_generator(self):
        return getattr(self.get_sampler(), "generator", None)

    def _skip_this_epoch(self) -> int:
        skip = self.skip_batches if self._resumed_skip is None else self._resumed_skip
        self._resumed_skip = None
        return skip

    def _starting_epoch(self) -> None:
        generator = self._sampler_generator()
        self._epoch_generator = None if generator is None else generator.get_state()

    def _position(self) -> dict:
        """The wrapped loader's state now, with the sampler generator's states at the epoch's start and now."""
        position = StatefulDataLoader.state_dict(self)
        generator = self._sampler_generator()
        if generator is not None:
            position[_GENERATOR] = (self._epoch_generator, generator.get_state())
        return position

    def _record_position(self, position: dict, finished: bool) -> None:
        # Resuming after the last batch starts the next epoch, whose number set_epoch must get.
        snapshot = {
            **position,
            _FINISHED: finished,
            _ITERATION: self.iteration + (1 if finished else 0),
            _SKIP: self.skip_batches if finished else 0,
        }
        if _GENERATOR in snapshot:  # the next epoch draws from the generator as it is now; this one from its start
            at_start, now = snapshot[_GENERATOR]
            snapshot[_GENERATOR] = now if finished else at_start
        self._snapshot = snapshot

    def state_dict(self) -> dict[str, Any]:
        """The position after the batch in use (before the first iteration: the start of the epoch)."""
        if self._snapshot is not None:
            return dict(self._snapshot)
        state = {**StatefulDataLoader.state_dict(self), _ITERATION: self.iteration, _SKIP: self.skip_batches}
        generator = self._sampler_generator()
        return state if generator is None else {**state, _GENERATOR: generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from `state_dict` at the next iteration (a state without accel's epoch keeps the current one)."""
        state_dict = dict(state_dict)
        self.iteration = state_dict.pop(_ITERATION, self.iteration)
        self._resumed_skip = state_dict.pop(_SKIP, None)
        generator_state, generator = state_dict.pop(_GENERATOR, None), self._sampler_generator()
        if generator_state is not None and generator is not None:
            # Set now, before the next epoch's RNG synchronization (which then gives process 0's everywhere).
            generator.set_state(generator_state)
        # Kept as the position until the next batch: asking the wrapped loader would start an iterator early.
        self._snapshot = {**state_dict, _ITERATION: self.iteration, _SKIP: self._resumed_skip}
        if generator_state is not None:
            self._snapshot[_GENERATOR] = generator_state
        StatefulDataLoader.load_state_dict(self, state_dict)

    def __reduce_ex__(self, protocol: int):
        # The variant class is made at run time: pickle the plain class, and make its variant again on loading.
        _, _, *state = super().__reduce_ex__(protocol)
        return (_new_variant_of, (self._plain_class,), *state)


_VARIANTS: dict[type, type] = {}


def stateful_variant(cls: type) -> type:
    """The class that is `cls` (one of accel's prepared loaders) on torchdata's `StatefulDataLoader`, made once."""
    if cls not in _VARIANTS:
        namespace = {"__module__": __name__, "__doc__": cls.__doc__, "_plain_class": cls}
        _VARIANTS[cls] = type(f"Stateful{cls.__name__}", (_SavesPosition, cls, StatefulDataLoader), namespace)
    return _VARIANTS[cls]


def _new_variant_of(cls: type) -> Any:
    """An empty instance of `cls`'s stateful variant (what unpickling fills in)."""
    variant = stateful_variant(cls)
    return variant.__new__(variant)


__all__ = ["stateful_variant"]
