"""Mixed-precision policies: how the forward runs and how the loss goes backward.

One `Precision` (base.py) per policy, chosen once by name (`precision_for`): `no`, `bf16`, and `fp16` with a
gradient scaler (torch's, unscaling through accel's fused kernel: scaler.py, grads.py), on CPU as on CUDA (HF
Accelerate silently runs "fp16" in fp32 on the CPU, without autocast or scaler). fp8 is refused
(UnsupportedFeatureError). hf_helpers.py: HF's get_mixed_precision_context_manager / get_grad_scaler, for code that
builds its own autocast or scaler.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from accel.precision.base import Precision
from accel.precision.grads import Measured
from accel.precision.scaler import FusedGradScaler, stepped_without_update
from accel.pytree import convert_to_fp32
from accel.unsupported import refuse


class FullPrecision(Precision):
    """`mixed_precision="no"`: fp32 forward, plain backward."""

    name = "no"

    def autocast(self, autocast_kwargs: dict | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wrap_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class AutocastPrecision(Precision):
    """The forward under torch.autocast(`dtype`), its outputs returned in fp32 (what bf16 and fp16 share)."""

    dtype: torch.dtype

    def autocast(self, autocast_kwargs: dict | None = None) -> contextlib.AbstractContextManager:
        kwargs = self.autocast_kwargs if autocast_kwargs is None else autocast_kwargs
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, **kwargs)

    def wrap_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        """Runs `model.forward` under autocast and returns fp32 outputs, as HF Accelerate does.

        The wrapper is bound to the model as a method (not a closure over it), so `copy.deepcopy` of the
        model binds the copy's own forward, as it would without accel.
        """
        if "_accel_original_forward" in model.__dict__:
            return model
        original = model.forward
        model._accel_original_forward = original
        model.forward = types.MethodType(autocast_forward(original.__func__, self), model)
        return model


class BF16Precision(AutocastPrecision):
    """`mixed_precision="bf16"`: the forward under torch.autocast(bfloat16), its outputs returned in fp32."""

    name = "bf16"
    dtype = torch.bfloat16


class FP16Precision(AutocastPrecision):
    """`mixed_precision="fp16"`: the forward under torch.autocast(float16), the loss scaled before backward.

    The scaler is torch's `GradScaler` for this device type (CPU too), unscaling with the fused kernel
    (`FusedGradScaler`): `AcceleratedOptimizer.step` steps through it, so a step whose gradients hold inf/nan is
    skipped and the scale backs off.
    """

    name = "fp16"
    dtype = torch.float16

    def __init__(self, device: torch.device, autocast_kwargs: dict | None = None, scaler_kwargs: dict | None = None):
        super().__init__(device, autocast_kwargs)
        self.scaler = FusedGradScaler(device.type, **(scaler_kwargs or {}))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._update_if_pending()
        self.scaler.scale(loss).backward(**kwargs)

    def _update_if_pending(self) -> None:
        # An optimizer stepped while another one, unscaled, did not (AcceleratedOptimizer.step then waits for
        # it): the new iteration starts with the update the last iteration did not make.
        if stepped_without_update(self.scaler):
            self.scaler.update()

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> Measured:
        with self.scaler.measuring() as measured:
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)
        return measured


def autocast_forward(forward: Any, precision: Precision) -> Any:
    """`forward(module, ...)` under the precision's autocast, outputs in fp32; to be bound with MethodType.

    A plain function (not a callable object): torch.compile must find its source to trace the forward.
    """

    @functools.wraps(forward)
    def forward_in_autocast(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with precision.autocast():
            outputs = forward(module, *args, **kwargs)
        return convert_to_fp32(outputs)

    return forward_in_autocast


def restore_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes `wrap_forward` (unwrap_model(keep_fp32_wrapper=False))."""
    original = model.__dict__.pop("_accel_original_forward", None)
    if original is not None:
        model.forward = original
    return model


PRECISIONS = {"no": FullPrecision, "bf16": BF16Precision, "fp16": FP16Precision}


def precision_for(
    mixed_precision: str, device: torch.device, autocast_kwargs: dict | None = None, scaler_kwargs: dict | None = None
) -> Precision:
    if mixed_precision == "fp8":
        raise refuse("FP8 training", "mixed_precision='fp8'", "Use mixed_precision='bf16' or 'fp16' (or 'no').")
    return PRECISIONS[mixed_precision](device, autocast_kwargs, scaler_kwargs)
