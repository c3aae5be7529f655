"""GradScaler whose unscale is accel's fused kernel (`accel.precision.grads.unscale_`).

It is torch's `GradScaler` in every other respect (scale, update, state_dict, skipping steps), so code and
checkpoints that know torch's scaler keep working. Two differences: gradients of fp16 parameters are unscaled
instead of refused (torch raises "Attempting to unscale FP16 gradients"; the arithmetic is fp32 either way), and
inside `measuring()` the sums of squares measured while unscaling are kept for the clip that follows.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.amp.grad_scaler import _MultiDeviceReplicator

from accel.precision import grads as grad_ops


class FusedGradScaler(torch.amp.GradScaler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._measured: grad_ops.Measured | None = None  # set only inside measuring()

    @contextlib.contextmanager
    def measuring(self) -> Iterator[grad_ops.Measured]:
        """Collects what every unscale inside the block measured (then drops it: it pins the gradients)."""
        self._measured = measured = grad_ops.Measured()
        try:
            yield measured
        finally:
            self._measured = None

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        with torch.no_grad():
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            # Usually every gradient is dense and on one device: one kernel call, no per-gradient Python.
            device = grads[0].device if grads else None
            measured = grads and grad_ops.try_unscale_fused_(
                grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))  # fmt: skip
            if measured:
                self._record(measured)
            else:
                for device, device_grads in self._grads_by_device(optimizer).items():
                    self._record(grad_ops.unscale_(
                        device_grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)))  # fmt: skip
        return per_device_found_inf._per_device_tensors

    def _record(self, measured: grad_ops.Measured) -> None:
        if self._measured is not None:
            self._measured.update(measured)

    @staticmethod
    def _grads_by_device(optimizer: torch.optim.Optimizer) -> dict[torch.device, list[torch.Tensor]]:
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    # As torch does: duplicate indices of fp16 values are summed first, so that an overflow of
                    # the sum is what gets checked.
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                by_device[grad.device].append(grad)
        return by_device
