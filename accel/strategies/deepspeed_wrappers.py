"""HF Accelerate's wrappers around a DeepSpeed engine's parts, as `Accelerator.prepare` returns them under DeepSpeed
(import path: `accel.utils.deepspeed`, like `accelerate.utils.deepspeed`).

The engine does the whole optimizer step inside `accelerator.backward` at an accumulation boundary (clipping, the
step, zeroing the gradients, stepping the scheduler it drives), so the optimizer's and that scheduler's `step` and
`zero_grad` do nothing: the training loop written for DDP runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.optimizer import AcceleratedOptimizer
from accel.scheduler import AcceleratedScheduler


class DeepSpeedEngineWrapper:
    """The engine behind `accelerator.backward`.

    Args:
        engine: A `deepspeed.DeepSpeedEngine`.
    """

    def __init__(self, engine: Any):
        self.engine = engine

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        """The engine's backward (it divides the loss by its accumulation steps), and its step when this backward
        ends an accumulation (`sync_gradients`, the Accelerator's)."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm the engine measured at its last step (a number, or None before any step)."""
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """The engine's optimizer; `step` and `zero_grad` do nothing (the engine's backward does both).

    Args:
        optimizer: The optimizer `deepspeed.initialize` returned (a ZeRO optimizer, or the user's).
    """

    def __init__(self, optimizer: Any):
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.__has_overflow__ = hasattr(self.optimizer, "overflow")

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass  # the engine zeroes the gradients after its step

    def step(self, closure: Any = None) -> None:
        pass  # the engine steps inside accelerator.backward

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine skipped its last step (an fp16 overflow)."""
        return bool(self.optimizer.overflow) if self.__has_overflow__ else False


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine drives (from the config, or a DeepSpeed schedule given in code); `step` does nothing.

    Args:
        scheduler: The scheduler `deepspeed.initialize` returned.
        optimizers: The prepared optimizer(s).
    """

    def __init__(self, scheduler: Any, optimizers: Any):
        super().__init__(scheduler, optimizers)

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass  # the engine steps it with the optimizer


__all__ = ["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper"]
