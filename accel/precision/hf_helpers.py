"""HF Accelerate's precision helpers (`accelerate.utils.get_mixed_precision_context_manager`, `get_grad_scaler`).

The Accelerator itself uses the policies of `accel.precision`; these two functions are for code that builds its
own autocast context or scaler the way HF Accelerate's utilities do.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accel.precision.scaler import FusedGradScaler
from accel.state import AcceleratorState, DistributedType
from accel.unsupported import refuse

_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None):
    """The autocast context of the Accelerator's mixed precision (an `Accelerator` must exist).

    As in HF Accelerate: without `native_amp` a no-op context; with it, `torch.autocast` on the state's device in
    float16 ("fp16") or bfloat16 ("bf16"), or in torch's default autocast dtype for the device ("no").

    Args:
        native_amp: Whether mixed precision is enabled (`Accelerator.native_amp`).
        autocast_kwargs: An `AutocastKwargs` (its changed fields go to `torch.autocast`).

    Raises:
        UnsupportedFeatureError: for mixed_precision "fp8", which accel does not run.
    """
    if not native_amp:
        return contextlib.nullcontext()
    state = AcceleratorState()
    kwargs = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else {}
    if state.mixed_precision == "fp8":
        raise refuse("FP8 training", "mixed_precision='fp8'", "Use mixed_precision='bf16' or 'fp16'.")
    dtype = _AUTOCAST_DTYPES.get(state.mixed_precision)
    if dtype is None:
        return torch.autocast(device_type=state.device.type, **kwargs)
    return torch.autocast(device_type=state.device.type, dtype=dtype, **kwargs)


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> FusedGradScaler:
    """A gradient scaler for fp16 training: accel's `FusedGradScaler` (torch's GradScaler, fused unscale).

    Unlike HF Accelerate, which returns a CUDA scaler even without CUDA (torch then disables it with a warning),
    the scaler is for CUDA when it is available and for the CPU otherwise, where accel trains fp16 too.

    Args:
        distributed_type: FSDP (sharded scaler) and XLA are refused: accel does not run them.
        **kwargs: `torch.amp.GradScaler` arguments (init_scale, growth_factor, backoff_factor, ...).
    """
    if distributed_type in (DistributedType.FSDP, DistributedType.XLA):
        name = DistributedType(distributed_type).value
        raise refuse(
            f"the {name} gradient scaler",
            f"get_grad_scaler(distributed_type={name})",
            "accel trains with DDP on CPUs or GPUs; call get_grad_scaler() without a distributed_type.",
        )
    return FusedGradScaler("cuda" if torch.cuda.is_available() else "cpu", **kwargs)


__all__ = ["get_grad_scaler", "get_mixed_precision_context_manager"]
