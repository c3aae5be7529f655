"""Typed Python wrappers over accel's native ops, each with its fake (meta) kernel.

Call sites do not use these directly when the extension may be missing: they go through the owner
module (e.g. accel.collectives.padding), which checks :func:`accel._ext.native_for` and otherwise runs the
pure-torch reference.
"""

from __future__ import annotations

import torch

from accel import _ext


def pad_into(src: torch.Tensor, dim: int, pad_value: float | int | bool, pad_first: bool, out: torch.Tensor) -> None:
    """Writes `src` into `out` along `dim` and `pad_value` everywhere else (before the data if `pad_first`)."""
    torch.ops.accel.pad_into.default(src, dim, pad_value, pad_first, out)


def _register_fakes() -> None:
    @torch.library.register_fake("accel::pad_into")
    def _pad_into_fake(src, dim, pad_value, pad_first, out):
        # The same checks as csrc/pad_pack.h, so a traced program fails where the kernel would.
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


if _ext.status().loaded:
    _register_fakes()
