"""GradScaler whose unscale is accel's fused kernel (`accel.precision.grads.unscale_`).

It is torch's `GradScaler` in every other respect (scale, update, state_dict, skipping steps), so code and
checkpoints that know torch's scaler keep working. Two differences: gradients of fp16 parameters are unscaled
instead of refused (torch raises "Attempting to unscale FP16 gradients"; the arithmetic is fp32 either way), and
inside `measuring()` the sums of squares measured while unscaling are kept for the clip that follows.

torch's private scaler fields (the per-optimizer record of an iteration) are read here only: the functions at the
end answer what the optimizer wrapper and the fp16 policy need to know about any torch `GradScaler`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator

from accel.precision import grads as grad_ops


class FusedGradScaler(torch.amp.GradScaler):
    """torch's GradScaler with the fused unscale. `sharding` (set by the strategy; None: whole gradients): where each
    process holds a shard of every gradient (FSDP2), it unscales the local shards and takes the inf/nan flag's
    maximum over the shards, so every process skips the same steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._measured: grad_ops.Measured | None = None  # set only inside measuring()
        self.sharding: grad_ops.Sharding | None = None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[grad_ops.Measured]:
        """Collects what every unscale inside the block measured (then drops it: it pins the gradients)."""
        self._measured = measured = grad_ops.Measured()
        try:
            yield measured
        finally:
            self._measured = None

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        with torch.no_grad():
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if self.sharding is not None and self.sharding.shards_gradients:
                return self._unscale_shards_(grads, inv_scale, found_inf)
            # Usually every gradient is dense and on one device: one kernel call, no per-gradient Python.
            device = grads[0].device if grads else None
            measured = grads and grad_ops.try_unscale_fused_(
                grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
            )
            if measured:
                self._record(measured)
            else:
                for device, device_grads in self._grads_by_device(optimizer).items():
                    self._record(
                        grad_ops.unscale_(
                            device_grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                        )
                    )
        return per_device_found_inf._per_device_tensors

    def _unscale_shards_(
        self, grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """The unscale of sharded gradients: this process's shards (one device), the flag maxed over shards."""
        local = self.sharding.local_gradients(grads)
        found = found_inf.to(local[0].device) if local else found_inf
        if local:
            self._record(grad_ops.unscale_(local, found, inv_scale.to(found.device)))
        found = self.sharding.max_across_shards(found)
        return {found.device: found}

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


def step_optimizer(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, closure=None) -> bool:
    """Steps `optimizer`, through `scaler` when one is enabled (a step whose gradients hold inf/nan is skipped and
    the scale backs off); returns whether the step was skipped. `Precision.optimizer_step` and HF's
    `AcceleratedOptimizer(optimizer, scaler=...)` step this way."""
    if scaler is None or not scaler.is_enabled():
        optimizer.step(closure)
        return False
    scaler.step(optimizer, closure)
    skipped = found_inf(scaler, optimizer)
    # Another optimizer sharing the scaler was unscaled (clip_grad_norm_ unscales all) but has not stepped: updating
    # now would forget that, and its step would divide its gradients by the scale a second time (HF Accelerate does
    # that). The last of them updates; the fp16 policy's next backward makes a missing update.
    if not unscaled_but_not_stepped(scaler, optimizer):
        scaler.update()
    return skipped


# --- what an iteration did, from torch's per-optimizer record (cleared by `update()`) ------------------------------


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s gradients held inf/nan in this iteration (its step was then skipped)."""
    record = scaler._per_optimizer_states[id(optimizer)]
    return sum(value.item() for value in record["found_inf_per_device"].values()) > 0


def unscaled_but_not_stepped(scaler: torch.amp.GradScaler, except_optimizer: torch.optim.Optimizer) -> bool:
    """Whether another optimizer than `except_optimizer` was unscaled in this iteration and has not stepped yet."""
    return any(
        record["stage"] is OptState.UNSCALED
        for key, record in scaler._per_optimizer_states.items()
        if key != id(except_optimizer)
    )


def stepped_without_update(scaler: torch.amp.GradScaler) -> bool:
    """Whether an optimizer stepped in this iteration and the scale has not been updated since."""
    return any(record["stage"] is OptState.STEPPED for record in scaler._per_optimizer_states.values())
