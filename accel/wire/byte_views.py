"""A tensor's values seen as bytes: how the transports, the dispatched batches and the checkpoint and offload writers
hand a tensor's memory to a copy, a collective or a file.

A tensor's memory holds its values only when no conjugate or negative bit is set: `x.conj()` and `x.conj().imag` are
views whose memory holds the unconjugated, unnegated values (`contiguous()` returns them as they are). Whatever is
sent goes through `dense_values`; whatever receives bytes in place checks `holds_values` (the native kernels follow
the same rule: csrc/dense_values.h).
"""

from __future__ import annotations

import torch


def dense_values(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values in one dense run of memory, detached: a view of it when it is one (no copy), else a copy
    with the view bits resolved."""
    values = tensor.detach()
    if values.is_conj() or values.is_neg():
        values = values.resolve_conj().resolve_neg()
    return values.contiguous()


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether bytes written into `tensor`'s memory in order set its values: contiguous, no conjugate or negative
    bit."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements as 1-d uint8, an alias (writes land in `tensor`), for a contiguous tensor.

    Not `reshape(-1).view(torch.uint8)`: torch counts a one-element tensor as contiguous whatever its stride
    (`torch.zeros(1, 3)[:, 0]` has stride 3), `contiguous()` returns it as it is and `reshape` keeps the stride,
    which a byte view refuses. `as_strided` with stride 1 addresses the same elements for every contiguous tensor.
    Tensors with the conjugate or negative bit set are refused by the byte view itself (their memory does not hold
    their values).

    Raises:
        ValueError: `tensor` is not contiguous (its elements are not one run in memory: pass `.contiguous()`).
    """
    if not tensor.is_contiguous():
        raise ValueError(
            f"byte_view: the tensor is not contiguous (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}); pass tensor.contiguous()"
        )
    return tensor.detach().as_strided((tensor.numel(),), (1,)).view(torch.uint8)
