"""How much memory a model's modules take: `compute_module_sizes`, the input of every device-map decision, and
the questions asked of it (`get_max_layer_size`, `calculate_maximum_sizes`, `dtype_byte_size`, ...)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters (and buffers) of `module`, its own or (`recurse`) its whole subtree's, once each (a tied
    parameter under its first name). `remove_non_persistent` leaves out the buffers a state dict does not hold."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skipped = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
        yield from ((name, buffer) for name, buffer in module.named_buffers(recurse=recurse) if name not in skipped)


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers registered with `persistent=False` (not in the state dict), the module's own or
    (`recurse`) its subtree's; `fqns`: named from `module` ("layer.0.cache"), else by their own attribute name.

    HF matches a subtree's buffers against their short names in `named_module_tensors(..., recurse=True)`, so a
    deeper non-persistent buffer is never left out there; accel compares full names."""
    found = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            found |= {f"{prefix}.{name}" if fqns and prefix else name for name in sub._non_persistent_buffers_set}
    return found


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
    buffers_only: bool = False,
) -> dict[str, int]:
    """{module name: bytes of its parameters and buffers}, for every module and tensor name ("" is the model).

    `dtype`: the dtype the weights will be loaded in; `special_dtypes`: per-tensor exceptions (name -> dtype),
    whatever their own dtype (e.g. weights kept in fp32); `buffers_only`: count the buffers alone.
    """
    dtype = None if dtype is None else _dtype(dtype)
    special = {name: _dtype(value) for name, value in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * torch.empty((), dtype=special[name]).element_size()
        else:
            size = tensor_bytes(tensor, dtype)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return dict(sizes)


def compute_module_total_buffer_size(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: dict[str, str | torch.dtype] | None = None
) -> int:
    """Bytes of all of `model`'s buffers, loaded as `dtype` (see `compute_module_sizes`)."""
    return compute_module_sizes(model, dtype, special_dtypes, buffers_only=True).get("", 0)


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes one element of `dtype` takes: 4 for float32, 1 for the float8 types, 1/8 for bool (a bit, as HF
    counts it for size estimates), 1/2 and 1/4 for accel.utils.CustomDtype's INT4 and INT2."""
    if dtype == torch.bool:
        return 1 / 8
    custom = {"int2": 1 / 4, "int4": 1 / 2, "fp8": 1}.get(str(getattr(dtype, "value", "")))
    if custom is not None:  # CustomDtype members (an enum of strings)
        return custom
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    bits = re.search(r"[^\d](\d+)$", str(dtype))
    if bits is None:
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return int(bits.group(1)) // 8


def get_max_layer_size(
    modules: list[tuple[str, nn.Module]], module_sizes: dict[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    """The size of the largest layer among `modules` (walked depth first) and the names of the layers of that size.

    A layer is a module without children, a module whose class is in `no_split_module_classes`, or a tensor (a
    `(name, tensor)` entry of `modules`). A layer missing from `module_sizes` (no parameters or buffers, e.g.
    dropout) has size 0.
    """
    largest, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if children and type(module).__name__ not in no_split_module_classes:
            pending[:0] = [(f"{name}.{child}", sub) for child, sub in children]
            continue
        size = module_sizes.get(name, 0)
        if size > largest:
            largest, names = size, [name]
        elif size == largest:
            names.append(name)
    return largest, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(bytes of the whole model, (bytes of its largest layer, their names)), layers split as transformers'
    `model._no_split_modules` says."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top = [*model.named_parameters(recurse=False), *model.named_children(), *model.named_buffers(recurse=False)]
    return sizes[""], get_max_layer_size(top, sizes, no_split)


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    """The names in `module_sizes` (as `compute_module_sizes` returns) that have no entry below them."""
    parents = {name.rsplit(".", 1)[0] for name in module_sizes if "." in name}
    return [name for name in module_sizes if name and name not in parents]


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, storage address, storage bytes): equal for tensors that share memory (views, tied weights)
    while they live. Meta tensors have no memory: their address is 0 and their size their own bytes."""
    if tensor.device.type == "meta":
        return tensor.device, 0, tensor.nelement() * tensor.element_size()
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()
