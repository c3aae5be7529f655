"""Typed Python wrappers over accel's native ops, each with its fake (meta) kernel directly under it.

Call sites do not use these directly when the extension may be missing: they go through the owner
module (e.g. accel.wire.padding), which checks :func:`accel._ext.native_for` and otherwise runs the
pure-torch reference. The fakes give shapes and the kernels' argument checks to tracing (torch.compile,
`torch.library.opcheck`); tests/ops/test_opcheck.py runs opcheck on every op the extension registers.
"""

from __future__ import annotations

import os

import torch

from accel import _ext
from accel.errors import DistributedOperationException

try:  # private, but where torch marks its own print as effectful (torch >= 2.4)
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
except ImportError:  # a torch that moved it: compiled programs drop write_tensors_ (test_opcheck's compile test fails)
    _register_effectful_op = None


def _fake(op: str):
    """`torch.library.register_fake(op)` when the extension is loaded; without it the op does not exist, and its
    fake is a plain function nobody calls."""
    if _ext.status().loaded:
        return torch.library.register_fake(op)
    return lambda fake: fake


def _effectful(op: str) -> None:
    """Marks `op`, whose only result is what it does outside the program (a file written), as a side effect:
    torch.compile drops a call without outputs or mutated inputs as dead code, but keeps an effectful one, in
    program order. torch's own print (aten::_print) is marked the same way."""
    if not _ext.status().loaded or _register_effectful_op is None:
        return
    namespace, name = op.split("::")
    try:
        _register_effectful_op(getattr(getattr(torch.ops, namespace), name).default, _EffectType.ORDERED)
    except (TypeError, ValueError, AssertionError, RuntimeError):  # a private API: a torch that changed it must
        pass  # still import accel (the compiled write is then dropped: test_opcheck's compile test says so)


def pad_into(src: torch.Tensor, dim: int, pad_value: float | int | bool, pad_first: bool, out: torch.Tensor) -> None:
    """Writes `src` into `out` along `dim` and `pad_value` everywhere else (before the data if `pad_first`)."""
    torch.ops.accel.pad_into.default(src, dim, pad_value, pad_first, out)


@_fake("accel::pad_into")
def _pad_into_fake(src, dim, pad_value, pad_first, out):
    # The same checks as csrc/pad_into.h, so a traced program fails where the kernel would.
    torch._check(src.dim() > 0, lambda: "accel::pad_into: src must have at least one dimension")
    torch._check(src.dim() == out.dim(), lambda: "accel::pad_into: src and out differ in rank")
    torch._check(src.dtype == out.dtype, lambda: "accel::pad_into: src and out differ in dtype")
    dim = dim % src.dim()
    for d in range(src.dim()):
        if d == dim:
            torch._check(out.shape[d] >= src.shape[d], lambda: f"accel::pad_into: out.size({d}) too small")
        else:
            torch._check(out.shape[d] == src.shape[d], lambda: f"accel::pad_into: out.size({d}) != src.size({d})")
    return None


def unscale_grads_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, sq_norms: torch.Tensor
) -> None:
    """grads *= inv_scale, found_inf = 1 on inf/nan, sq_norms[i] = sum of squares of grads[i] after; one pass."""
    torch.ops.accel.unscale_grads_.default(grads, found_inf, inv_scale, sq_norms)


def _check_grads(op: str, grads: list[torch.Tensor], device: torch.device) -> None:
    for i, grad in enumerate(grads):
        torch._check(grad.device == device, lambda: f"{op}: grads[{i}] is on {grad.device}, expected {device}")
        torch._check(
            grad.dtype in (torch.float32, torch.float16, torch.bfloat16),
            lambda: f"{op}: grads[{i}] is {grad.dtype}; the fused kernels take float32, float16, bfloat16",
        )


@_fake("accel::unscale_grads_")
def _unscale_grads_fake(grads, found_inf, inv_scale, sq_norms):
    torch._check(
        found_inf.numel() == 1 and found_inf.dtype == torch.float32,
        lambda: "accel::unscale_grads_: found_inf must be a one-element float32 tensor",
    )
    torch._check(
        inv_scale.numel() == 1 and inv_scale.dtype == torch.float32,
        lambda: "accel::unscale_grads_: inv_scale must be a one-element float32 tensor",
    )
    torch._check(
        sq_norms.dtype == torch.float64 and sq_norms.shape == (len(grads),),
        lambda: "accel::unscale_grads_: sq_norms must be a float64 vector with one entry per grad",
    )
    _check_grads("accel::unscale_grads_", grads, found_inf.device)
    return None


def clip_grads_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """grads *= min(1, max_norm / (total_norm + 1e-6)), as clip_grad_norm_ scales them."""
    torch.ops.accel.clip_grads_.default(grads, total_norm, max_norm)


@_fake("accel::clip_grads_")
def _clip_grads_fake(grads, total_norm, max_norm):
    if grads:
        torch._check(
            total_norm.numel() == 1 and total_norm.dtype == torch.float32,
            lambda: "accel::clip_grads_: total_norm must be a one-element float32 tensor",
        )
        _check_grads("accel::clip_grads_", grads, grads[0].device)
    return None


def write_tensors_(fd: int, path: str, header: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> None:
    """Writes `header`, then each tensor's bytes at header.numel() + offsets[i], into the open file `fd` (`path`
    names it); fsyncs it. A failed system call raises OSError with its errno."""
    status = _io_status()
    torch.ops.accel.write_tensors_.default(fd, path, header, tensors, offsets, status)
    _raise_failed_call(status, "write", path)


@_fake("accel::write_tensors_")
def _write_tensors_fake(fd, path, header, tensors, offsets, status):
    torch._check(len(tensors) == len(offsets), lambda: "accel::write_tensors_: one offset per tensor")
    return None


_effectful("accel::write_tensors_")


def read_tensors_(fd: int, path: str, offsets: list[int], outs: list[torch.Tensor]) -> None:
    """Reads the bytes at file offsets[i] of the open file `fd` (`path` names it) into the contiguous tensors
    outs[i]. A failed system call raises OSError with its errno; a file too short or changed while read, an error
    naming it."""
    status = _io_status()
    torch.ops.accel.read_tensors_.default(fd, path, offsets, outs, status)
    _raise_failed_call(status, "read", path)


@_fake("accel::read_tensors_")
def _read_tensors_fake(fd, path, offsets, outs, status):
    torch._check(len(outs) == len(offsets), lambda: "accel::read_tensors_: one offset per tensor")
    return None


def _io_status() -> torch.Tensor:
    return torch.tensor([0, -1], dtype=torch.int64)


@torch.compiler.disable  # a compiled program reads the status eagerly (a graph break), as a failure must raise
def _raise_failed_call(status: torch.Tensor, verb: str, path: str) -> None:
    """The OSError of the system call the file op's `status` reports ({errno, tensor index or -1}), if one failed."""
    code, tensor = status.tolist()
    if code:
        what = f"{verb}, tensor {tensor}" if tensor >= 0 else verb
        raise OSError(code, f"{os.strerror(code)} ({what})", path)


def map_file_leased(fd: int, size: int, path: str) -> torch.Tensor:
    """The first `size` bytes of the open file `fd` as a uint8 tensor over a private mapping guarded by a read lease
    (a writer of the file gets the bytes copied into memory first; see accel.checkpoint.leased_mapping); an empty
    tensor when no lease can be taken. `path` names the file in warnings."""
    return torch.ops.accel.map_file_leased.default(fd, size, path)


@_fake("accel::map_file_leased")
def _map_file_leased_fake(fd, size, path):
    torch._check(size > 0, lambda: f"accel::map_file_leased: size must be positive, got {size}")
    # `size` bytes, or none when the lease is refused: known only when the call runs.
    return torch.empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.uint8)


# The group life-cycle ops below take and return integers only: no fake is needed (fake tensor mode runs them as
# they are), and none is traceable (each call changes the process's groups).


def shm_group_create(
    rank: int, world: int, token: str, slot_bytes: int, timeout_s: float, oversubscribed: bool = False
) -> int:
    """Creates this rank's shared-memory segment; returns the group's handle (accel.wire.shm_process_group sets a
    process group's one group up with these ops; its backend and accel's own collectives then share it).

    `oversubscribed`: more ranks on this host than CPUs, so waits sleep early instead of spinning.
    """
    return torch.ops.accel.shm_group_create.default(rank, world, token, slot_bytes, timeout_s, oversubscribed)


def shm_group_locator(group: int) -> list[int]:
    """[pid, fd]: where peers open this rank's segment (until `shm_group_finish_setup`)."""
    return torch.ops.accel.shm_group_locator.default(group)


def shm_group_attach(group: int, locators: list[int]) -> None:
    """Maps every peer's segment, given every rank's locator concatenated in rank order."""
    torch.ops.accel.shm_group_attach.default(group, locators)


def shm_group_finish_setup(group: int) -> None:
    """Closes this rank's descriptor of its segment: once every rank has attached."""
    torch.ops.accel.shm_group_finish_setup.default(group)


def shm_group_destroy(group: int) -> None:
    """Drops the handle: the group's segments are unmapped (and peers still waiting on this rank fail at once) as soon
    as no backend built on it and no call holds it. The handle is invalid after."""
    torch.ops.accel.shm_group_destroy.default(group)


# Starts the message of a native error raised because the ranks' calls disagree (csrc/shm_bindings/shared_group.h).
_MISMATCH = "accel collective mismatch: "


def _eager(leaves, pad_value: object = 0) -> bool:
    """Whether a shared-memory collective may call its kernel through accel._C's direct entry instead of torch.ops.

    The kernel is the same; the direct entry skips the dispatcher's boxing, which costs a small gather on one host
    about as much as its whole rendezvous. Only when nothing needs to see the call as an op: every leaf a plain
    tensor (no fake or other subclass), no dispatch or function mode (tracing, FakeTensorMode), torch.compile not
    tracing, and a fill value the direct entry reads (bool, int, float).
    """
    if type(pad_value) not in PLAIN_FILL or not untraced():
        return False
    for leaf in leaves:
        if type(leaf) is not torch.Tensor:
            return False
    return True


def untraced() -> bool:
    """No dispatch or function mode is active and torch.compile is not tracing: nothing needs to see a call as an
    op, so a plain-tensor call may take accel._C's direct entry (`_eager`, `accel.collectives.direct`)."""
    return not (_dispatch_modes() or _function_modes() or torch.compiler.is_compiling())


PLAIN_FILL = (bool, int, float)  # the fill values the direct entry reads
_dispatch_modes, _function_modes = torch._C._len_torch_dispatch_stack, torch._C._len_torch_function_stack
_C = None


def _direct():
    """accel._C (loaded: a shared-memory group exists only with it), imported once."""
    global _C
    if _C is None:
        from accel import _C as module

        _C = module
    return _C


def _collective_error(error: RuntimeError) -> Exception:
    """`error`, or the DistributedOperationException it stands for when the ranks' calls disagree."""
    message = str(error)
    if not message.startswith(_MISMATCH):
        return error
    return DistributedOperationException(message[len(_MISMATCH) :].split("\nException raised from", 1)[0])


def shm_all_gather(
    group: int,
    leaves: list[torch.Tensor],
    pad_dim: int | None = None,
    pad_value: float | int | bool = 0,
    pad_first: bool = False,
    call: str = "gather",
) -> list[torch.Tensor]:
    """Every rank's leaves concatenated along dim 0 (padded along `pad_dim` first), in one rendezvous.

    `call` names the collective in the DistributedOperationException raised when ranks run different ones.
    """
    try:
        if _eager(leaves, pad_value):
            return _direct().shm_all_gather(group, leaves, pad_dim, pad_value, pad_first, call)
        return torch.ops.accel.shm_all_gather.default(group, leaves, pad_dim, pad_value, pad_first, call)
    except RuntimeError as error:
        raise _collective_error(error) from None


@_fake("accel::shm_all_gather")
def _shm_all_gather_fake(group, leaves, pad_dim, pad_value, pad_first, call):
    # The gathered sizes depend on what the other ranks send: unknown until the call.
    ctx = torch.library.get_ctx()
    outputs = []
    for leaf in leaves:
        shape = [ctx.new_dynamic_size(), *leaf.shape[1:]]
        if pad_dim is not None and pad_dim % leaf.dim() != 0:
            shape[pad_dim % leaf.dim()] = ctx.new_dynamic_size()
        outputs.append(leaf.new_empty(shape))
    return outputs


def shm_all_gather_direct(
    group: int,
    leaves: list[torch.Tensor],
    pad_dim: int | None,
    pad_value: float | int | bool,
    pad_first: bool,
    call: str,
) -> list[torch.Tensor]:
    """`shm_all_gather` through accel._C's direct entry, for callers that checked what `_eager` checks (plain
    tensors, a fill value in PLAIN_FILL, `untraced()`): the hottest calls, which make those checks in one pass."""
    try:
        return _direct().shm_all_gather(group, leaves, pad_dim, pad_value, pad_first, call)
    except RuntimeError as error:
        raise _collective_error(error) from None


def shm_all_gather_bytes(
    group: int, data: torch.Tensor, call: str = "gather_object"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's 1-d uint8 `data` concatenated in rank order, and each rank's length (int64)."""
    try:
        if _eager((data,)):
            return _direct().shm_all_gather_bytes(group, data, call)
        return torch.ops.accel.shm_all_gather_bytes.default(group, data, call)
    except RuntimeError as error:
        raise _collective_error(error) from None


@_fake("accel::shm_all_gather_bytes")
def _shm_all_gather_bytes_fake(group, data, call):
    ctx = torch.library.get_ctx()
    return data.new_empty(ctx.new_dynamic_size()), data.new_empty(ctx.new_dynamic_size(), dtype=torch.int64)


def shm_pad_across_processes_direct(
    group: int, leaves: list[torch.Tensor], dim: int, pad_value: float | int | bool, pad_first: bool
) -> tuple[list[torch.Tensor], list[int]]:
    """`shm_pad_across_processes` through accel._C's direct entry (see `shm_all_gather_direct`)."""
    try:
        return _direct().shm_pad_across_processes(group, leaves, dim, pad_value, pad_first)
    except RuntimeError as error:
        raise _collective_error(error) from None


def shm_pad_across_processes(
    group: int, leaves: list[torch.Tensor], dim: int, pad_value: float | int | bool, pad_first: bool
) -> tuple[list[torch.Tensor], list[int]]:
    """One exchange of shapes: the padded copies of the leaves smaller along `dim` than on some rank, and their
    indices in `leaves` (HF's pad_across_processes semantics; leaves without `dim` stay as they are)."""
    try:
        if _eager(leaves, pad_value):
            return _direct().shm_pad_across_processes(group, leaves, dim, pad_value, pad_first)
        return torch.ops.accel.shm_pad_across_processes.default(group, leaves, dim, pad_value, pad_first)
    except RuntimeError as error:
        raise _collective_error(error) from None


@_fake("accel::shm_pad_across_processes")
def _shm_pad_across_processes_fake(group, leaves, dim, pad_value, pad_first):
    # Which leaves come back padded depends on the other ranks' shapes: not even the count is known.
    raise torch._subclasses.fake_tensor.DynamicOutputShapeException(torch.ops.accel.shm_pad_across_processes.default)


REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")


def reduce_in_order_(parts: list[torch.Tensor], op: str, out: torch.Tensor, factor: float = 1.0) -> None:
    """out = parts[0] op parts[1] op ... elementwise, in that order (the shared-memory process group's arithmetic;
    `op` one of REDUCE_OPS, premul_sum being the sum times `factor`)."""
    torch.ops.accel.reduce_in_order_.default(parts, op, out, factor)


@_fake("accel::reduce_in_order_")
def _reduce_in_order_fake(parts, op, out, factor=1.0):
    torch._check(len(parts) > 0, lambda: "accel::reduce_in_order_: needs at least one part")
    torch._check(op in REDUCE_OPS, lambda: f"accel::reduce_in_order_: unknown reduction {op!r}")
    for i, part in enumerate(parts):
        torch._check(part.dtype == out.dtype, lambda: f"accel::reduce_in_order_: parts[{i}] is {part.dtype}")
        torch._check(part.numel() == out.numel(), lambda: f"accel::reduce_in_order_: parts[{i}] differs in size")
    return None


def stream_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i] = sources[i] for every pair (CPU, same dtype and shape), large contiguous tensors with
    non-temporal stores: a copy that is read once later (a checkpoint's staging copy) bypasses the cache."""
    torch.ops.accel.stream_copy_.default(targets, sources)


@_fake("accel::stream_copy_")
def _stream_copy_fake(targets, sources):
    torch._check(len(targets) == len(sources), lambda: "accel::stream_copy_: as many targets as sources")
    for i, (target, source) in enumerate(zip(targets, sources)):
        torch._check(target.dtype == source.dtype, lambda: f"accel::stream_copy_: targets[{i}] differs in dtype")
        torch._check(target.shape == source.shape, lambda: f"accel::stream_copy_: targets[{i}] differs in shape")
    return None
