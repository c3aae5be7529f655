"""`Precision`: the seam every mixed-precision policy fills (as Lightning Fabric's precision plugins do).

The Accelerator holds one policy, chosen once by name (`accel.precision.precision_for`), and asks it how the
forward runs (`autocast`, `wrap_forward`), how the loss goes backward (`backward`) and how gradients are brought
back to their true scale before clipping and stepping (`unscale`). It never asks which policy it holds.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any

import torch

from accel.precision.grads import Measured
from accel.precision.scaler import step_optimizer


class Precision(abc.ABC):
    """A mixed-precision policy.

    Args:
        device: The device the forward runs on (its type picks the autocast flavour).
        autocast_kwargs: The Accelerator's `AutocastKwargs` as `torch.autocast` keyword arguments.
        scaler_kwargs: `GradScalerKwargs` as `torch.amp.GradScaler` keyword arguments (policies that scale).

    Attributes:
        name: The `mixed_precision` value the policy implements ("no", "bf16", "fp16").
        scaler: The gradient scaler (a `torch.amp.GradScaler`), or None for policies that do not scale the loss.
    """

    name: str
    scaler: torch.amp.GradScaler | None = None
    _sharding = None

    def __init__(self, device: torch.device, autocast_kwargs: dict | None = None, scaler_kwargs: dict | None = None):
        self.device = device
        self.autocast_kwargs = autocast_kwargs or {}

    @property
    def sharding(self):
        """Where the gradients this policy unscales live (the strategy; see accel.precision.grads.Sharding)."""
        return self._sharding

    @sharding.setter
    def sharding(self, sharding) -> None:
        self._sharding = sharding
        if self.scaler is not None:
            self.scaler.sharding = sharding

    @abc.abstractmethod
    def autocast(self, autocast_kwargs: dict | None = None) -> contextlib.AbstractContextManager:
        """The forward's autocast context; `autocast_kwargs` replaces the Accelerator's AutocastKwargs."""

    @abc.abstractmethod
    def wrap_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with its forward running under this policy (the same module, changed in place, or as is)."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagates `loss` (`kwargs` go to `Tensor.backward`)."""
        loss.backward(**kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Steps `optimizer` through this policy's scaler (if any); returns whether the step was skipped (fp16:
        inf/nan gradients)."""
        return step_optimizer(optimizer, self.scaler, closure)

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> Measured:
        """Divides the optimizers' gradients by the loss scale; returns the gradient norms measured doing so.

        Without a scaler there is nothing to divide and nothing measured.
        """
        return Measured()
