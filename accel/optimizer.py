"""AcceleratedOptimizer: the user's optimizer, stepping only when gradients are synchronized."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from accel import availability
from accel.precision.scaler import step_optimizer
from accel.pytree import send_to_device
from accel.state import AcceleratorState, GradientState


def move_to_device(state: Any, device: Any) -> Any:
    """`state` (an optimizer state dict: nested dicts, lists and tuples) with every tensor on `device` (HF's name;
    the same walk as `send_to_device`)."""
    return send_to_device(state, device)


def patch_optimizer_step(accelerated_optimizer: AcceleratedOptimizer, method: Callable) -> Callable:
    """`method` (an optimizer's `step`) wrapped to set `accelerated_optimizer._accelerate_step_called = True` before
    each call (HF's helper: with a gradient scaler, a step the scaler skips never calls it). accel's
    AcceleratedOptimizer reads skipped steps from the scaler itself and does not patch."""

    def patched_step(*args: Any, **kwargs: Any) -> Any:
        accelerated_optimizer._accelerate_step_called = True
        return method(*args, **kwargs)

    return patched_step


def lomo_optimizer_classes() -> tuple[type, ...] | None:
    """lomo_optim's (Lomo, AdaLomo), or None when it is not installed (it is not imported until needed)."""
    if not availability.is_lomo_available():
        return None
    from lomo_optim import AdaLomo, Lomo

    return (Lomo, AdaLomo)


def is_lomo_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is a LOMO optimizer (it updates the weights in its fused backward, not in `step`)."""
    classes = lomo_optimizer_classes()
    return classes is not None and isinstance(optimizer, classes)


def _takes_set_to_none(zero_grad: Callable) -> bool:
    """Whether an optimizer's `zero_grad` takes `set_to_none` (torch's do, some others do not).

    Asked at every step: the answer is kept per function (a bound method's, so per optimizer class), as
    `inspect.signature` costs about as much as zeroing a small model's gradients.
    """
    function = getattr(zero_grad, "__func__", zero_grad)
    try:
        return _function_takes_set_to_none(function)
    except TypeError:  # an unhashable callable object
        return "set_to_none" in inspect.signature(zero_grad).parameters


@functools.lru_cache(maxsize=128)
def _function_takes_set_to_none(function: Callable) -> bool:
    return "set_to_none" in inspect.signature(function).parameters


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that `step`/`zero_grad` are no-ops while gradients accumulate.

    It is an instance of `torch.optim.Optimizer` (as in HF Accelerate), but every attribute lives on the
    wrapped optimizer; `state_dict`/`load_state_dict` move state to the training device.

    Args:
        optimizer: the user's optimizer.
        device_placement: move the optimizer state to the Accelerator's device.
        scaler: a gradient scaler (fp16); its skipped steps make `step_was_skipped` true.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True, scaler: Any = None):
        # No super().__init__: the wrapped optimizer owns param_groups, state and defaults.
        self.optimizer = optimizer
        self.scaler = scaler
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self._is_overflow = False
        self._updates_in_backward = is_lomo_optimizer(optimizer)  # known once: step() is the hot path
        if device_placement:
            self.optimizer.load_state_dict(move_to_device(self.optimizer.state_dict(), self.accelerator_state.device))

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @state.setter
    def state(self, state: dict) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict]) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.device_placement:
            state_dict = move_to_device(state_dict, self.accelerator_state.device)
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if not self.gradient_state.sync_gradients:
            return  # keep accumulating
        zero_grad = self.optimizer.zero_grad
        if _takes_set_to_none(zero_grad):
            zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        else:
            zero_grad()

    def step(self, closure: Any = None) -> None:
        if not self.gradient_state.sync_gradients or self._updates_in_backward:
            return  # accumulating; or a LOMO optimizer, which updated the weights in its backward
        self._is_overflow = step_optimizer(self.optimizer, self.scaler, closure)

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):  # schedule-free optimizers
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped because of inf/nan gradients (fp16)."""
        return self._is_overflow

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("accelerator_state", "gradient_state")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
