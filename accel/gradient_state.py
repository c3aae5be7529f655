"""`GradientState`: gradient accumulation and dataloader bookkeeping, shared by every instance (a singleton).

Its own module, below `accel.state` (which re-exports it, HF Accelerate's path) and below the collectives: the
uneven-step protocol (`accel.wire.uneven`) asks it for the active dataloader, and `PartialState`'s barrier
runs that protocol.
"""

from __future__ import annotations

import weakref

from accel.env_vars import get_flag

__all__ = ["GradientState"]


class GradientState:
    """Gradient accumulation and dataloader bookkeeping, shared by every instance (a singleton).

    Attributes:
        sync_gradients: Whether this step synchronizes (and applies) the accumulated gradients.
        end_of_dataloader: Whether the active dataloader yielded its last batch.
        remainder: The number of real samples in the global batch of the active dataloader's last step (-1 when
            unknown or outside a dataloader); gather_for_metrics keeps that many gathered rows.
        num_steps: Steps to accumulate over (plugin `num_steps`, default 1).
        adjust_scheduler: Whether the scheduler steps are adjusted for accumulation (False without a plugin; the
            Accelerator's plugin defaults it to True).
        sync_with_dataloader: Whether the end of a dataloader forces a sync (default True).
        active_dataloader: The innermost dataloader being iterated, or None.
        dataloader_references: The dataloaders being iterated, outermost first (weak references; None first).

    Args:
        gradient_accumulation_plugin: Any object with `to_kwargs()` (a `GradientAccumulationPlugin`), or None.
            A later instance with different kwargs updates them.
    """

    _shared_state: dict = {}  # one plain dict for every instance, as accel.state.SharedDict is

    def __init__(self, gradient_accumulation_plugin=None):
        self.__dict__ = self._shared_state
        plugin_kwargs = gradient_accumulation_plugin.to_kwargs() if gradient_accumulation_plugin is not None else {}
        if not self.initialized:
            self.sync_gradients = True
            self._dataloader_references_ref = [None]
            self.plugin_kwargs = plugin_kwargs
            self._is_xla_gradients_synced = False
        elif gradient_accumulation_plugin is not None:
            self.plugin_kwargs = plugin_kwargs

    @property
    def initialized(self) -> bool:
        """Whether the shared state has been set up."""
        return GradientState._shared_state != {}

    @property
    def num_steps(self) -> int:
        """Steps to accumulate gradients over."""
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        """Whether the scheduler should be adjusted for gradient accumulation."""
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether the end of a dataloader forces a gradient sync and resets the step count."""
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active dataloader has yielded its last batch."""
        return self.in_dataloader and self.active_dataloader.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Samples added by padding the active dataloader's last batch; -1 outside a dataloader."""
        return self.active_dataloader.remainder if self.in_dataloader else -1

    @property
    def active_dataloader(self):
        """The innermost dataloader being iterated, or None."""
        return GradientState.current_dataloader()

    @staticmethod
    def current_dataloader():
        """`active_dataloader` without making an instance: every collective asks (None before any instance)."""
        references = GradientState._shared_state.get("_dataloader_references_ref")
        innermost = references[-1] if references else None  # not the whole list
        return innermost() if innermost is not None else None

    @property
    def dataloader_references(self) -> list:
        """The dataloaders being iterated (held by weak references so they can be garbage collected)."""
        return [ref() if ref is not None else None for ref in self._dataloader_references_ref]

    @dataloader_references.setter
    def dataloader_references(self, references: list) -> None:
        self._dataloader_references_ref = [weakref.ref(ref) if ref is not None else None for ref in references]

    @property
    def is_xla_gradients_synced(self) -> bool:
        """HF Accelerate's XLA flag (whether XLA gradients were all-reduced before the step). accel runs no XLA:
        it stays as last set (False at first), True under ACCELERATE_USE_FSDP as in HF."""
        return get_flag("USE_FSDP") or self._is_xla_gradients_synced

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, is_synced: bool) -> None:
        self._is_xla_gradients_synced = is_synced

    @property
    def in_dataloader(self) -> bool:
        """Whether a dataloader is being iterated."""
        return self.active_dataloader is not None

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Samples in the last global batch: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader) -> None:
        self.dataloader_references += [dataloader]

    def _remove_dataloader(self, dataloader) -> None:
        self.dataloader_references = [ref for ref in self.dataloader_references if ref is not dataloader]

    @staticmethod
    def _reset_state() -> None:
        """Forgets the shared state; internal and test use only."""
        GradientState._shared_state.clear()
