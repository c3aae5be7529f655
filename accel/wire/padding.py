"""Padding a tensor along one dim, in this process: the pack step of the padded all-gather, the padding
`pad_across_processes` (accel.collectives.pad_across) applies once the shapes are known, `pad_input_tensors`."""

from __future__ import annotations

from typing import Any

import torch

from accel import _ext, ops
from accel.errors import DistributedOperationException
from accel.pytree import recursively_apply


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
    shape = list(tensor.shape)
    shape[dim] = size
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    ops.pad_into(tensor, dim, pad_value, pad_first, out)
    return out


def _pad_to_largest(tensor: torch.Tensor, shapes: list, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    """`tensor` padded along `dim` to the largest of `shapes` (every process's shape of it)."""
    if len({len(shape) for shape in shapes}) != 1:
        raise DistributedOperationException(
            f"pad_across_processes: ranks hold tensors of different ranks (shapes {shapes})"
        )
    if dim >= tensor.dim() or dim < -tensor.dim():
        return tensor  # HF leaves tensors without that dim untouched
    dim = dim % tensor.dim()
    max_size = max(shape[dim] for shape in shapes)
    if max_size == tensor.shape[dim]:
        return tensor
    return pad_tensor(tensor, dim, max_size, pad_index, pad_first)


def pad_to_largest_shapes(
    leaves: list[torch.Tensor], shapes: list[list[tuple[int, ...]]], dim: int, pad_index: Any, pad_first: bool
) -> list[torch.Tensor]:
    """`leaves` each padded to the largest of its shapes in `shapes` (every process's shapes of its leaves)."""
    counts = [len(rank_shapes) for rank_shapes in shapes]
    if len(set(counts)) > 1:  # every rank sees the same counts, so all raise (none goes on to hang)
        raise DistributedOperationException(
            f"pad_across_processes: the processes pass different numbers of tensors ({counts})"
        )
    return [
        _pad_to_largest(leaf, [rank_shapes[i] for rank_shapes in shapes], dim, pad_index, pad_first)
        for i, leaf in enumerate(leaves)
    ]


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Every tensor of a nested list/tuple/dict grown with zeros along `dim` to the smallest multiple of
    `num_processes` that is at least `batch_size`, so that the batch splits evenly across processes (HF uses it
    to split inputs for pipeline-parallel inference).

    HF Accelerate's arithmetic for the padded size is wrong for many sizes (6 rows on 4 processes give 9, a batch
    that already splits evenly is padded too, and it always pads dim 0); accel pads to the next multiple along
    `dim`, and returns a tensor that needs no padding as it is.

    Args:
        tensor: A tensor or a nested list/tuple/dict of tensors, each with `batch_size` rows along `dim`.
        batch_size: The number of rows along `dim`.
        num_processes: The number of processes the batch is split across.
        dim: The dim to pad.

    Returns:
        The same structure with padded tensors.

    Example::

        pad_input_tensors(torch.ones(3, 4, 4), batch_size=3, num_processes=4).shape   # (4, 4, 4)
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}")
    size = -(-batch_size // num_processes) * num_processes

    def pad(leaf: torch.Tensor) -> torch.Tensor:
        if leaf.dim() == 0 or leaf.shape[dim] >= size:
            return leaf
        return pad_tensor(leaf, dim, size, 0)

    return recursively_apply(pad, tensor, error_on_other_type=True)
