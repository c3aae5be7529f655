"""How much memory a model's modules take: `compute_module_sizes`, the input of every device-map decision."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn


def named_module_tensors(module: nn.Module, include_buffers: bool = True, recurse: bool = False
                         ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The parameters (and buffers) of `module`, its own or (`recurse`) its whole subtree's, once each (a tied
    parameter under its first name)."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        yield from module.named_buffers(recurse=recurse)


def _dtype(value: str | torch.dtype) -> torch.dtype:
    return getattr(torch, value.removeprefix("torch.")) if isinstance(value, str) else value


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes `tensor` takes once loaded as `dtype`: floating-point tensors are converted (never widened, as a
    checkpoint in half precision stays half), integer and bool tensors keep their own dtype."""
    size = tensor.element_size()
    if dtype is not None and tensor.is_floating_point():
        size = min(size, torch.empty((), dtype=dtype).element_size())
    return tensor.numel() * size


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
) -> dict[str, int]:
    """{module name: bytes of its parameters and buffers}, for every module and tensor name ("" is the model).

    `dtype`: the dtype the weights will be loaded in; `special_dtypes`: per-tensor exceptions (name -> dtype),
    whatever their own dtype (e.g. weights kept in fp32).
    """
    dtype = None if dtype is None else _dtype(dtype)
    special = {name: _dtype(value) for name, value in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    for name, tensor in named_module_tensors(model, recurse=True):
        if name in special:
            size = tensor.numel() * torch.empty((), dtype=special[name]).element_size()
        else:
            size = tensor_bytes(tensor, dtype)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return dict(sizes)
