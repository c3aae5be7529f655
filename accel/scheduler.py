"""AcceleratedScheduler: steps a learning-rate scheduler the way HF Accelerate does."""

from __future__ import annotations

from typing import Any

from accel.state import AcceleratorState, GradientState


class AcceleratedScheduler:
    """Steps the scheduler only when the optimizers really stepped.

    With `split_batches=False` every process sees its own batch, so one optimizer step consumed
    `num_processes` batches: the scheduler steps that many times (bounded by `total_steps` for OneCycleLR).

    Args:
        scheduler: the user's scheduler.
        optimizers: the prepared optimizer(s) it follows.
        step_with_optimizer: follow the optimizers (False: step whenever asked).
        split_batches: batches are split across processes rather than one per process.
    """

    def __init__(self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True, split_batches: bool = False):
        self.scheduler = scheduler
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        for _ in range(1 if self.split_batches else AcceleratorState().num_processes):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def print_lr(self, *args: Any, **kwargs: Any) -> None:
        return self.scheduler.print_lr(*args, **kwargs)
