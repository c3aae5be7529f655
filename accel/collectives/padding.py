"""Padding a tensor along one dim: the pack step of the padded all-gather, and `pad_across_processes`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from accel import _ext
from accel.collectives import uneven
from accel.collectives.pytree import replace_tensor_leaves, tensor_leaves
from accel.collectives.transport import select_transport


def pad_reference(
    tensor: torch.Tensor, dim: int, size: int, pad_value: float | int | bool = 0, pad_first: bool = False
) -> torch.Tensor:
    """Pure-torch reference of `accel::pad_into`: `tensor` grown to `size` along `dim`, dtype preserved.

    Unlike HF Accelerate (`new_zeros(...) + pad_index`, which turns bool into int64 and int into float for
    a float pad), the result always keeps the input's dtype; the pad value is converted as `new_full` does.
    """
    dim = dim % tensor.dim() if tensor.dim() else dim
    shape = list(tensor.shape)
    offset = size - shape[dim] if pad_first else 0
    shape[dim] = size
    out = tensor.new_full(shape, pad_value)
    out.narrow(dim, offset, tensor.shape[dim]).copy_(tensor)
    return out


def pad_tensor(
    tensor: torch.Tensor, dim: int, size: int, pad_value: float | int | bool = 0, pad_first: bool = False
) -> torch.Tensor:
    """`tensor` grown to `size` along `dim`, filled with `pad_value`; native kernel when available.

    Args:
        tensor: at least 1-d.
        dim: the dim to grow (negative counts from the end).
        size: the new size of `dim`, at least `tensor.shape[dim]`.
        pad_value: the fill value, converted to `tensor.dtype`.
        pad_first: put the padding before the data instead of after it.

    Returns:
        A new contiguous tensor of `tensor`'s dtype and device.
    """
    if tensor.dim() == 0:
        raise RuntimeError("accel::pad_into: src must have at least one dimension, got a 0-d tensor")
    # The native op writes into `out` and has no backward; the reference is differentiable.
    needs_grad = tensor.requires_grad and torch.is_grad_enabled()
    if needs_grad or not _ext.native_for("pad_into", tensor.device):
        return pad_reference(tensor, dim, size, pad_value, pad_first)
    from accel import ops

    shape = list(tensor.shape)
    shape[dim] = size
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    ops.pad_into(tensor, dim, pad_value, pad_first, out)
    return out


def _pad_to_largest(tensor: torch.Tensor, shapes: list, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    """`tensor` padded along `dim` to the largest of `shapes` (every process's shape of it)."""
    if len({len(shape) for shape in shapes}) != 1:
        raise ValueError(f"pad_across_processes: ranks hold tensors of different ranks (shapes {shapes})")
    if dim >= tensor.dim() or dim < -tensor.dim():
        return tensor  # HF leaves tensors without that dim untouched
    dim = dim % tensor.dim()
    max_size = max(shape[dim] for shape in shapes)
    if max_size == tensor.shape[dim]:
        return tensor
    return pad_tensor(tensor, dim, max_size, pad_index, pad_first)


def _pad_leaves(tensor: Any, shapes: list[list[tuple[int, ...]]], dim: int, pad_index: Any, pad_first: bool) -> Any:
    """`tensor` with each leaf padded to the largest of its shapes in `shapes` (every process's leaf shapes)."""
    leaves = tensor_leaves(tensor, "pad_across_processes")
    counts = [len(rank_shapes) for rank_shapes in shapes]
    if len(set(counts)) > 1:  # every rank sees the same shapes, so all raise (none goes on to hang)
        raise ValueError(f"pad_across_processes: the processes pass different numbers of tensors ({counts})")
    padded = [_pad_to_largest(leaf, [rank_shapes[i] for rank_shapes in shapes], dim, pad_index, pad_first)
              for i, leaf in enumerate(leaves)]
    return replace_tensor_leaves(tensor, padded)


def _pad_in_uneven_step(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    parts = uneven.exchange("pad_across_processes", [tuple(leaf.shape) for leaf in tensor_leaves(tensor, "pad_across_processes")])
    return _pad_leaves(tensor, [part for part in parts if part is not None], dim, pad_index, pad_first)


@uneven.uneven_aware("pad_across_processes", _pad_in_uneven_step)
def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pads every tensor in a (nested list/tuple/dict of) tensor(s) to the largest size across ranks along `dim`.

    One exchange of shapes for the whole structure, then each tensor is padded where it is.

    Args:
        tensor: a tensor or a nested list/tuple/dict of tensors.
        dim: the dim to pad.
        pad_index: the fill value.
        pad_first: pad at the beginning instead of the end.

    Returns:
        The same structure; a tensor already at the largest size is returned as is.

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: the processes hold tensors with different numbers of dims.

    Example (2 ranks)::

        t = torch.ones(rank + 1, 2)           # rank 0: shape (1, 2), rank 1: shape (2, 2)
        pad_across_processes(t).shape          # both ranks: (2, 2); rank 0's second row is 0
    """
    leaves = tensor_leaves(tensor, "pad_across_processes")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    # Every rank joins the shape exchange before anything is decided, so all ranks decide alike (a rank
    # returning early on its own would leave the others waiting in the collective).
    shapes = select_transport(leaves).all_gather_shapes(leaves)
    return _pad_leaves(tensor, shapes, dim, pad_index, pad_first)
