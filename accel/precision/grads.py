"""Gradient unscale and clip: accel's fused kernels, and the pure-torch reference they fall back to.

torch's way, which HF Accelerate runs: `GradScaler.unscale_` reads and writes every gradient, then
`clip_grad_norm_` reads them all again for the norm and a third time to scale them. The fused way:
`accel::unscale_grads_` unscales, checks for inf/nan and measures each gradient's sum of squares in one pass, so
the clip only has to scale (`accel::clip_grads_`), and does nothing when the norm is under `max_norm`.

Results: unscaled gradients and `found_inf` are bit-identical to torch's. The norm agrees to rounding: the
kernels sum squares in fp32 within chunks of 32 Ki elements and in fp64 across chunks, where torch takes a norm
per tensor in the gradient's dtype and then the norm of those; for fp16/bf16 gradients ours is the more exact
one, and it is returned in fp32 (torch returns it in the gradients' dtype). Given the same norm, clipping is
bit-identical. Gradients the kernels do not take (sparse, non-contiguous, fp64, several devices, a norm other
than 2) go through torch's own functions.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

import torch

from accel import _ext, ops

FUSED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def fusable(grad: torch.Tensor) -> bool:
    """Whether the fused kernels take `grad`: dense, contiguous, fp32/fp16/bf16, on a device with a kernel."""
    return bool(_fusable_on_device([grad], grad.device))


def native_on(device_type: str) -> bool:
    """Whether the fused kernels run on this device type ("cpu", "cuda")."""
    return _ext.native_for("unscale_grads_", device_type)


def _fusable_on_device(grads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The grads the kernels take, of `grads` all on `device` (the kernel itself refuses another device).

    Per-gradient Python is what sets of thousands of small gradients pay, so the device is checked once.
    """
    if not native_on(device.type):
        return []
    strided, dtypes = torch.strided, FUSED_DTYPES
    return [g for g in grads if g.layout is strided and g.dtype in dtypes and g.is_contiguous()]


class Sharding(Protocol):
    """Where gradients live (an `accel.strategies.Strategy`): whole on every process, or one shard per process."""

    shards_gradients: bool

    def local_gradients(self, grads: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def sharded(self, grads: list[torch.Tensor]) -> list[bool]: ...

    def sum_across_shards(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def max_across_shards(self, tensor: torch.Tensor) -> torch.Tensor: ...


class Measured:
    """Sums of squares measured while unscaling: a list of (gradients, their sums) per kernel call.

    It holds the gradients it measured, so keep it no longer than the unscale-then-clip it serves.
    """

    def __init__(self) -> None:
        self.sources: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor, int]] | None = None

    def add(self, grads: list[torch.Tensor], sq_norms: torch.Tensor) -> None:
        self.sources.append((grads, sq_norms))
        self._index = None

    def update(self, other: Measured) -> None:
        for grads, sq_norms in other.sources:
            self.add(grads, sq_norms)

    def covers_exactly(self, grads: list[torch.Tensor]) -> bool:
        """Whether `grads` are exactly the measured gradients (the usual unscale-then-clip case)."""
        measured = self.sources[0][0] if len(self.sources) == 1 else [g for source, _ in self.sources for g in source]
        if len(measured) != len(grads):
            return False
        # Usually the same tensors in the same order: compared by identity at C speed (map + operator.is_).
        return all(map(operator.is_, measured, grads)) or set(map(id, measured)) == set(map(id, grads))

    def lookup(self, grad: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        if self._index is None:
            self._index = {id(g): (g, sq, i) for grads, sq in self.sources for i, g in enumerate(grads)}
        entry = self._index.get(id(grad))
        if entry is None or entry[0] is not grad:
            return None
        return entry[1], entry[2]

    def __len__(self) -> int:
        return sum(len(grads) for grads, _ in self.sources)


def unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> Measured:
    """`torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`, any float dtype mix.

    All `grads` are dense tensors on `found_inf`'s device. Returns the sums of squares the fused kernel measured
    on the way (empty where the reference ran).
    """
    measured = try_unscale_fused_(grads, found_inf, inv_scale)
    if measured is not None:
        return measured
    measured = Measured()
    fused = _fusable_on_device(grads, found_inf.device)
    if fused:
        sq_norms = torch.empty(len(fused), dtype=torch.float64, device=found_inf.device)
        ops.unscale_grads_(fused, found_inf, inv_scale, sq_norms)
        measured.add(fused, sq_norms)
    if len(fused) < len(grads):
        fused_ids = {id(grad) for grad in fused}
        unscale_reference_([grad for grad in grads if id(grad) not in fused_ids], found_inf, inv_scale)
    return measured


def try_unscale_fused_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> Measured | None:
    """All `grads` through the fused kernel in one call, or None (nothing touched) when it does not take them all.

    The kernel checks every argument before it writes anything, in C++, so trying it costs nothing and spares
    thousands of small gradients a check each in Python; the caller sorts them out only when one is refused.
    """
    if not grads or not native_on(found_inf.device.type):
        return None
    sq_norms = torch.empty(len(grads), dtype=torch.float64, device=found_inf.device)
    try:
        ops.unscale_grads_(grads, found_inf, inv_scale, sq_norms)
    except (RuntimeError, NotImplementedError):  # a sparse, strided, fp64 or other-device gradient
        return None
    measured = Measured()
    measured.add(grads, sq_norms)
    return measured


def unscale_reference_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch's unscale, per dtype; bf16 on CUDA (which torch's kernel lacks) with the same fp32 arithmetic."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_dtype[grad.dtype].append(grad)
    for dtype, group in by_dtype.items():
        if dtype == torch.bfloat16 and found_inf.device.type == "cuda":
            for grad in group:
                found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(grad)).any().float()))
                grad.copy_(grad.float().mul_(inv_scale))
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    measured: Measured | None = None,
    sharding: Sharding | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, fused where it can be; returns the total norm (fp32 when fused).

    `measured`: sums of squares that `unscale_` just measured for some of these gradients (they are not read
    again); the norm of the others is measured by a read-only pass of the same kernel. `sharding` (a strategy):
    where each process holds a shard of every gradient (FSDP2's DTensors), the kernels see the local shards and
    the sum of squares is summed across the shards before the root, in one all-reduce.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    sharding = sharding if sharding is not None and sharding.shards_gradients else None
    local = grads if sharding is None else sharding.local_gradients(grads)
    measured = measured or Measured()
    if sharding is None and float(norm_type) == 2.0 and len(measured.sources) == 1 and measured.covers_exactly(local):
        sum_sq = measured.sources[0][1].sum()  # fusable by construction
    elif not _fused_clip_applies(local, norm_type):
        if sharding is None or all(sharding.sharded(grads)):  # torch's own, over DTensors too (it reduces them)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return _clip_shards_and_whole_reference_(local, sharding.sharded(grads), max_norm, norm_type, sharding)
    elif sharding is None:
        sum_sq = total_sum_of_squares_(local, measured)
    else:
        sum_sq = _sum_of_squares_across_shards(local, sharding.sharded(grads), measured, sharding)
    total_norm = sum_sq.sqrt().to(torch.float32)
    ops.clip_grads_(local, total_norm, float(max_norm))
    return total_norm


def _sum_of_squares_across_shards(
    local: list[torch.Tensor], sharded: list[bool], measured: Measured, sharding: Sharding
) -> torch.Tensor:
    """The sum of squares of gradients of which every process holds a shard (summed across processes, in one
    all-reduce) plus that of gradients every process holds whole (ignored parameters: counted once)."""
    shards = [g for g, is_shard in zip(local, sharded) if is_shard]
    whole = [g for g, is_shard in zip(local, sharded) if not is_shard]
    zero = torch.zeros((), dtype=torch.float64, device=local[0].device)
    total = sharding.sum_across_shards(total_sum_of_squares_(shards, measured) if shards else zero)
    return total + total_sum_of_squares_(whole, measured) if whole else total


def _clip_shards_and_whole_reference_(
    local: list[torch.Tensor], sharded: list[bool], max_norm: float, norm_type: float, sharding: Sharding
) -> torch.Tensor:
    """torch's clip (its norm, clip coefficient and 1e-6) over gradients some of which are shards and some whole on
    every process (FSDP's ignored parameters), which torch's own cannot mix: the shards' part is combined across
    processes, the whole gradients' part counted once."""
    norm_type = float(norm_type)
    shards = [g for g, is_shard in zip(local, sharded) if is_shard]
    whole = [g for g, is_shard in zip(local, sharded) if not is_shard]
    device = local[0].device

    def part(grads: list[torch.Tensor]) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=device)
        stacked = torch.stack(norms).to(device)
        return stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum()

    if norm_type == float("inf"):
        total_norm = torch.maximum(sharding.max_across_shards(part(shards)), part(whole))
    else:
        total_norm = (sharding.sum_across_shards(part(shards)) + part(whole)).pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(local, coefficient)
    return total_norm


def _fused_clip_applies(grads: list[torch.Tensor], norm_type: float) -> bool:
    if not grads or float(norm_type) != 2.0 or len({g.device for g in grads}) != 1:
        return False
    return len(_fusable_on_device(grads, grads[0].device)) == len(grads)


def total_norm_(grads: list[torch.Tensor], measured: Measured) -> torch.Tensor:
    """The 2-norm of all `grads` together (fp32, on their device, no host sync), reusing `measured` sums."""
    return total_sum_of_squares_(grads, measured).sqrt().to(torch.float32)


def total_sum_of_squares_(grads: list[torch.Tensor], measured: Measured) -> torch.Tensor:
    """The sum of squares of all `grads` together (fp64, on their device), reusing `measured` sums."""
    indices_by_source: dict[int, tuple[torch.Tensor, list[int]]] = {}
    unmeasured = []
    for grad in grads:
        found = measured.lookup(grad)
        if found is None:
            unmeasured.append(grad)
        else:
            sq_norms, index = found
            indices_by_source.setdefault(id(sq_norms), (sq_norms, []))[1].append(index)
    parts = [_selected_sum(sq_norms, indices) for sq_norms, indices in indices_by_source.values()]
    if unmeasured:
        parts.append(sq_norms_(unmeasured).sum())
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _selected_sum(sq_norms: torch.Tensor, indices: list[int]) -> torch.Tensor:
    if indices == list(range(sq_norms.numel())):
        return sq_norms.sum()  # every measured gradient is clipped: the usual case, no gather
    return sq_norms[torch.tensor(indices, device=sq_norms.device)].sum()


def sq_norms_(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's sum of squares (fp64), by the unscale kernel in its read-only mode (inv_scale == 1)."""
    device = grads[0].device
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    sq_norms = torch.empty(len(grads), dtype=torch.float64, device=device)
    ops.unscale_grads_(grads, found_inf, one, sq_norms)
    return sq_norms
