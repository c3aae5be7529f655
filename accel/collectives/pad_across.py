"""`pad_across_processes`: every tensor of a pytree padded to the largest size any process has along a dim.

One exchange of shapes for the whole structure through the transport `select_transport` picks (on one host,
shared memory, the padding done in the same native call), then the local padding of `accel.wire.padding`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from accel.collectives import direct
from accel.pytree import replace_tensor_leaves, tensor_leaves
from accel.wire import uneven
from accel.wire.padding import pad_to_largest_shapes
from accel.wire.shm_transport import SharedMemoryTransport
from accel.wire.transport_selection import select_transport


class CannotPadNestedTensorWarning(UserWarning):
    """`pad_across_processes` met a nested tensor (torch.nested), which it leaves as it is."""


def _with_padded(
    tensor: Any, leaves: list[torch.Tensor], regular: list[torch.Tensor], padded: list[torch.Tensor]
) -> Any:
    """`tensor` with each of its `regular` leaves (those of `leaves` that are not nested) replaced by `padded`."""
    if isinstance(tensor, torch.Tensor):  # the common case: one leaf, padded or not (a nested one is not in `regular`)
        return padded[0] if padded else tensor
    if all(new is old for new, old in zip(padded, regular)):
        return replace_tensor_leaves(tensor, leaves)
    if len(regular) == len(leaves):
        return replace_tensor_leaves(tensor, padded)
    replacements = iter(padded)
    return replace_tensor_leaves(tensor, [leaf if leaf.is_nested else next(replacements) for leaf in leaves])


def _paddable(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves that are not nested tensors (torch.nested: no shape to pad to), warning when there are any."""
    regular = [leaf for leaf in leaves if not leaf.is_nested]
    if len(regular) < len(leaves):
        warnings.warn(
            "Cannot pad nested tensors without more information. Leaving unprocessed.",
            CannotPadNestedTensorWarning,
            stacklevel=5,
        )
    return regular


def _pad_in_uneven_step(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    leaves = tensor_leaves(tensor, "pad_across_processes")
    regular = _paddable(leaves)
    parts = uneven.exchange("pad_across_processes", [tuple(leaf.shape) for leaf in regular])
    shapes = [part for part in parts if part is not None]
    return _with_padded(tensor, leaves, regular, pad_to_largest_shapes(regular, shapes, dim, pad_index, pad_first))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
    padded = direct.pad_across_processes(tensor, dim, pad_index, pad_first)
    return _pad_across_processes(tensor, dim, pad_index, pad_first) if padded is None else padded


@uneven.uneven_aware("pad_across_processes", _pad_in_uneven_step)
def _pad_across_processes(tensor: Any, dim: int, pad_index: Any, pad_first: bool) -> Any:
    """`pad_across_processes`'s general path (any pytree, nested tensors, any transport)."""
    leaves = tensor_leaves(tensor, "pad_across_processes")
    regular = _paddable(leaves)
    transport = select_transport(regular)
    # A shared-memory group has two ranks or more; otherwise ask torch.distributed.
    if not isinstance(transport, SharedMemoryTransport) and not _distributed():
        return tensor
    # Every rank joins the shape exchange before anything is decided, so all ranks decide alike (a rank
    # returning early on its own would leave the others waiting in the collective).
    padded = transport.pad_to_largest(regular, dim, pad_index, pad_first)
    return _with_padded(tensor, leaves, regular, padded)
