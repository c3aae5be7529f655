"""Padding a tensor along one dim: the pack step of the padded all-gather, and `pad_across_processes`."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from accel import _ext
from accel.collectives import uneven
from accel.collectives.errors import DistributedOperationException
from accel.pytree import recursively_apply, replace_tensor_leaves, tensor_leaves
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
        raise DistributedOperationException(
            f"pad_across_processes: ranks hold tensors of different ranks (shapes {shapes})")
    if dim >= tensor.dim() or dim < -tensor.dim():
        return tensor  # HF leaves tensors without that dim untouched
    dim = dim % tensor.dim()
    max_size = max(shape[dim] for shape in shapes)
    if max_size == tensor.shape[dim]:
        return tensor
    return pad_tensor(tensor, dim, max_size, pad_index, pad_first)


class CannotPadNestedTensorWarning(UserWarning):
    """`pad_across_processes` met a nested tensor (torch.nested), which it leaves as it is."""


def pad_to_largest_shapes(leaves: list[torch.Tensor], shapes: list[list[tuple[int, ...]]], dim: int, pad_index: Any,
                          pad_first: bool) -> list[torch.Tensor]:  # fmt: skip
    """`leaves` each padded to the largest of its shapes in `shapes` (every process's shapes of its leaves)."""
    counts = [len(rank_shapes) for rank_shapes in shapes]
    if len(set(counts)) > 1:  # every rank sees the same counts, so all raise (none goes on to hang)
        raise DistributedOperationException(
            f"pad_across_processes: the processes pass different numbers of tensors ({counts})")
    return [_pad_to_largest(leaf, [rank_shapes[i] for rank_shapes in shapes], dim, pad_index, pad_first)
            for i, leaf in enumerate(leaves)]  # fmt: skip


def _with_padded(tensor: Any, leaves: list[torch.Tensor], regular: list[torch.Tensor], padded: list[torch.Tensor]
                 ) -> Any:  # fmt: skip
    """`tensor` with each of its `regular` leaves (those of `leaves` that are not nested) replaced by `padded`."""
    if all(new is old for new, old in zip(padded, regular)):
        return tensor if isinstance(tensor, torch.Tensor) else replace_tensor_leaves(tensor, leaves)
    if len(regular) == len(leaves):
        return replace_tensor_leaves(tensor, padded)
    replacements = iter(padded)
    return replace_tensor_leaves(tensor, [leaf if leaf.is_nested else next(replacements) for leaf in leaves])


def _paddable(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves that are not nested tensors (torch.nested: no shape to pad to), warning when there are any."""
    regular = [leaf for leaf in leaves if not leaf.is_nested]
    if len(regular) < len(leaves):
        warnings.warn("Cannot pad nested tensors without more information. Leaving unprocessed.",
                      CannotPadNestedTensorWarning, stacklevel=4)  # fmt: skip
    return regular


def _pad_in_uneven_step(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    leaves = tensor_leaves(tensor, "pad_across_processes")
    regular = _paddable(leaves)
    parts = uneven.exchange("pad_across_processes", [tuple(leaf.shape) for leaf in regular])
    shapes = [part for part in parts if part is not None]
    return _with_padded(tensor, leaves, regular, pad_to_largest_shapes(regular, shapes, dim, pad_index, pad_first))


@uneven.uneven_aware("pad_across_processes", _pad_in_uneven_step)
def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pads every tensor in a (nested list/tuple/dict of) tensor(s) to the largest size across ranks along `dim`.

    One exchange of shapes for the whole structure (on one host: through shared memory, nothing pickled, the
    padding done in the same native call), then each tensor is padded where it is. Nested tensors
    (torch.nested) are left as they are, with a `CannotPadNestedTensorWarning`, as in HF Accelerate.

    Args:
        tensor: a tensor or a nested list/tuple/dict of tensors.
        dim: the dim to pad.
        pad_index: the fill value.
        pad_first: pad at the beginning instead of the end.

    Returns:
        The same structure; a tensor already at the largest size is returned as is.

    Raises:
        TypeError: a leaf is not a tensor.
        DistributedOperationException: the processes pass different numbers of tensors, or tensors with
            different numbers of dims (raised on every process).

    Example (2 ranks)::

        t = torch.ones(rank + 1, 2)           # rank 0: shape (1, 2), rank 1: shape (2, 2)
        pad_across_processes(t).shape          # both ranks: (2, 2); rank 0's second row is 0
    """
    leaves = tensor_leaves(tensor, "pad_across_processes")
    regular = _paddable(leaves)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    # Every rank joins the shape exchange before anything is decided, so all ranks decide alike (a rank
    # returning early on its own would leave the others waiting in the collective).
    padded = select_transport(regular).pad_to_largest(regular, dim, pad_index, pad_first)
    return _with_padded(tensor, leaves, regular, padded)


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
