"""`DataLoaderShard` on torchdata's `StatefulDataLoader`: a prepared loader that saves and resumes its position.

(Imported only when `use_stateful_dataloader=True`: it needs torchdata.) A prepared loader reads one batch
ahead (to know which batch is last), so the wrapped loader is always one batch further than the user. The state
is therefore snapshotted just before each read-ahead: `state_dict()` taken while a batch is in use describes the
position after that batch, and loading it resumes with the next one (after the last batch of an epoch: with the
next epoch). The loader's epoch count (`iteration`, which `set_epoch` uses) is part of the state.
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from accel.data.loaders import DataLoaderShard

_FINISHED = "_iterator_finished"  # StatefulDataLoader's key: the epoch is over
_ITERATION = "_accel_iteration"  # ours: the epoch the state belongs to (ignored by StatefulDataLoader)


class StatefulDataLoaderShard(DataLoaderShard, StatefulDataLoader):
    """A `DataLoaderShard` whose `state_dict()` / `load_state_dict()` save and restore the position in the epoch.

    Args: as `DataLoaderShard` (and `StatefulDataLoader`'s `snapshot_every_n_steps` for worker processes).
    """

    _snapshot: dict | None = None

    def _before_reading_ahead(self) -> None:
        self._snapshot = StatefulDataLoader.state_dict(self)

    def _after_reading_ahead(self) -> None:
        self._snapshot[_FINISHED] = self.end_of_dataloader
        # Resuming after the last batch starts the next epoch, whose number set_epoch must get.
        self._snapshot[_ITERATION] = self.iteration + (1 if self.end_of_dataloader else 0)

    def state_dict(self) -> dict[str, Any]:
        """The position after the batch in use (before the first iteration: the start of the epoch)."""
        if self._snapshot is None:
            return {**StatefulDataLoader.state_dict(self), _ITERATION: self.iteration}
        return dict(self._snapshot)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from `state_dict` at the next iteration."""
        state_dict = dict(state_dict)
        self.iteration = state_dict.pop(_ITERATION, self.iteration)
        self._snapshot = None
        StatefulDataLoader.load_state_dict(self, state_dict)


__all__ = ["StatefulDataLoaderShard"]
