"""Pytree helpers for batches: map over tensors, move, concatenate, slice, count rows, and pack for a broadcast.

A batch is a tensor or a nest of dicts (any `Mapping`, rebuilt as its own type when possible), lists, tuples
and named tuples of tensors; other leaves (strings, numbers) are carried through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch


def _rebuild(container: Any, items) -> Any:
    if isinstance(container, Mapping):
        items = dict(items)
        try:
            return type(container)(items)
        except TypeError:
            return items
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # named tuple
        return type(container)(*items)
    return type(container)(items)


def map_leaves(fn: Callable[[Any], Any], data: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """`data` with every leaf for which `is_leaf` holds replaced by `fn(leaf)`."""
    if is_leaf(data):
        return fn(data)
    if isinstance(data, Mapping):
        return _rebuild(data, ((key, map_leaves(fn, value, is_leaf)) for key, value in data.items()))
    if isinstance(data, (list, tuple)):
        return _rebuild(data, [map_leaves(fn, value, is_leaf) for value in data])
    return data


def _is_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor)


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """`data` with every tensor replaced by `fn(tensor)`."""
    return map_leaves(fn, data, _is_tensor)


def tensors(data: Any) -> list[torch.Tensor]:
    """The tensors of `data`, in traversal order."""
    found = []
    map_tensors(found.append, data)
    return found


def _movable(data: Any) -> bool:
    """A tensor, or another object with a `.to` method that is not a container we recurse into."""
    if isinstance(data, torch.Tensor):
        return True
    return callable(getattr(data, "to", None)) and not isinstance(data, (Mapping, list, tuple))


def to_device(data: Any, device: torch.device | str | None, non_blocking: bool = False) -> Any:
    """`data` with its tensors (and other objects that have `.to`) on `device` (None: unchanged)."""
    if device is None:
        return data

    def move(leaf: Any) -> Any:
        try:
            return leaf.to(device, non_blocking=non_blocking)
        except TypeError:  # a `.to` without non_blocking
            return leaf.to(device)

    return map_leaves(move, data, _movable)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor of `data` (0 when it holds no tensor with a dimension)."""
    for tensor in tensors(data):
        if tensor.dim() > 0:
            return tensor.shape[0]
    return 0


def concatenate(batches: list) -> Any:
    """The batches joined along dim 0, leaf by leaf (they must share their structure)."""
    first = batches[0]
    if _is_tensor(first):
        return torch.cat(batches, dim=0)
    if isinstance(first, Mapping):
        return _rebuild(first, ((key, concatenate([batch[key] for batch in batches])) for key in first))
    if isinstance(first, (list, tuple)):
        return _rebuild(first, [concatenate([batch[i] for batch in batches]) for i in range(len(first))])
    return first


def slice_tensors(data: Any, tensor_slice: slice, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    """`data` with every tensor (with a dimension) sliced along dim 0; the signature of `slice_fn_for_dispatch`."""
    return map_tensors(lambda tensor: tensor[tensor_slice] if tensor.dim() > 0 else tensor, data)


def take_rows(data: Any, count: int) -> Any:
    """`count` rows of `data`, cycling over its rows (`data` needs at least one)."""
    def cycle(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        index = torch.arange(count, device=tensor.device) % tensor.shape[0]
        return tensor.index_select(0, index)

    return map_tensors(cycle, data)


# --- Packing a batch for one broadcast ------------------------------------------------------------------------------


_ALIGNMENT = 16


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of a packed batch lies in the byte buffer."""

    shape: tuple
    dtype: torch.dtype
    offset: int
    nbytes: int


def pack(data: Any) -> tuple[Any, torch.Tensor]:
    """(structure, buffer): `data` with its tensors replaced by `TensorSpec`s, and their bytes in one uint8 tensor."""
    pieces, offset = [], 0

    def spec(tensor: torch.Tensor) -> TensorSpec:
        nonlocal offset
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        start = offset
        padding = -raw.numel() % _ALIGNMENT  # keeps every offset a multiple of any dtype's size, for `view`
        pieces.extend([raw, torch.zeros(padding, dtype=torch.uint8)])
        offset += raw.numel() + padding
        return TensorSpec(tuple(tensor.shape), tensor.dtype, start, raw.numel())

    structure = map_tensors(spec, data)
    buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return structure, buffer


def unpack(structure: Any, buffer: torch.Tensor) -> Any:
    """The batch `pack` packed: tensors are views of `buffer`, on its device."""
    def tensor(spec: TensorSpec) -> torch.Tensor:
        raw = buffer[spec.offset:spec.offset + spec.nbytes]
        return raw.view(spec.dtype).reshape(spec.shape)

    return map_leaves(tensor, structure, lambda leaf: isinstance(leaf, TensorSpec))
