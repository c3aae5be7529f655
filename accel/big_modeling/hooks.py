"""Hooks around a module's forward, and the one big-model inference needs: `AlignDevicesHook`.

`add_hook_to_module(module, hook)` replaces `module.forward` with one that calls `hook.pre_forward` (which may
change the arguments), the original forward, then `hook.post_forward` (which may change the output);
`remove_hook_from_module` puts the original back. `AlignDevicesHook` moves a module's inputs to the device it
runs on and, for an offloaded module, brings its weights in from a weights map (CPU memory or an offload
folder) just for the forward and drops them after, so the module holds only meta tensors between calls.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accel.big_modeling.sizes import named_module_tensors
from accel.collectives.pytree import send_to_device


class ModelHook:
    """Override what you need; every method returns what it was given by default."""

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks, run in order (post_forward in order too)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = list(hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Wraps `module.forward` with `hook` (after an existing hook with `append`, else replacing it)."""
    existing = getattr(module, "_hf_hook", None)
    if existing is not None:
        if append:
            hook = SequentialHook(existing, hook)
        else:
            remove_hook_from_module(module)
    original = module.__dict__.get("_old_forward", module.forward)
    module = hook.init_hook(module)
    module._hf_hook = hook
    module._old_forward = original
    # A partial of a module-level function, not a closure: copy.deepcopy of the module then binds the copy.
    module.forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
    with torch.no_grad() if module._hf_hook.no_grad else contextlib.nullcontext():
        output = module._old_forward(*args, **kwargs)
    return module._hf_hook.post_forward(module, output)


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Undoes `add_hook_to_module` (on every submodule too with `recurse`)."""
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
        original = module.__dict__.pop("_old_forward")
        if getattr(original, "__self__", None) is module and original.__func__ is type(module).forward:
            module.__dict__.pop("forward", None)  # the class's own forward again
        else:
            module.forward = original
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def set_module_tensor_to_device(module: nn.Module, tensor_name: str, device: torch.device | int | str,
                                value: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:  # fmt: skip
    """Puts the parameter or buffer `tensor_name` ("layer.0.weight") of `module` on `device`, with `value`'s
    data when given. A floating-point value takes the tensor's dtype unless `dtype` says otherwise; a parameter
    stays a Parameter of its class, with its requires_grad."""
    owner_name, _, name = tensor_name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    is_buffer = name in owner._buffers
    if not is_buffer and name not in owner._parameters:
        raise ValueError(f"'{tensor_name}' is neither a parameter nor a buffer of {type(module).__name__}")
    old = owner._buffers[name] if is_buffer else owner._parameters[name]
    if value is None and old is not None and old.device.type == "meta" and torch.device(device).type != "meta":
        raise ValueError(f"'{tensor_name}' is on the meta device (never loaded): pass its value to place it")
    new = old if value is None else value
    target_dtype = dtype if dtype is not None else (old.dtype if new.is_floating_point() and old is not None else None)
    with torch.no_grad():
        new = new.to(device=device, dtype=target_dtype if new.is_floating_point() else None)
    if is_buffer:
        owner._buffers[name] = new
        return
    requires_grad = old.requires_grad if old is not None else False
    cls = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
    owner._parameters[name] = cls(new, requires_grad=requires_grad and new.is_floating_point())


def place_tied(module: nn.Module, device: torch.device | int | str, recurse: bool = True) -> None:
    """Moves the module's parameters and buffers to `device`; a parameter known under several names (tied) is
    moved once and stays one parameter under all of them."""
    by_identity: dict[int, list[str]] = {}
    for name, param in module.named_parameters(recurse=recurse, remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    for names in by_identity.values():
        set_module_tensor_to_device(module, names[0], device)
        owner_name, _, attr = names[0].rpartition(".")
        moved = (module.get_submodule(owner_name) if owner_name else module)._parameters[attr]
        for alias in names[1:]:
            owner_name, _, attr = alias.rpartition(".")
            (module.get_submodule(owner_name) if owner_name else module)._parameters[attr] = moved
    for name, _ in module.named_buffers(recurse=recurse):
        set_module_tensor_to_device(module, name, device)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in a (nested) structure."""
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        for item in data:
            device = find_device(item)
            if device is not None:
                return device
    return None


class AlignDevicesHook(ModelHook):
    """Runs a module on `execution_device`: moves its inputs there and, when `offload`, loads its weights from
    `weights_map` (names relative to the module) for each forward and puts them back on meta after.

    Args:
        execution_device: where the forward runs (and where the weights are put when not offloaded).
        offload: keep the weights in `weights_map` between forwards (the module holds meta tensors).
        io_same_device: return the output on the device the first input came from.
        weights_map: name -> tensor for the offloaded weights (e.g. an OffloadedWeightsLoader).
        offload_buffers: offload buffers too (else they are moved to `execution_device` once).
        place_submodules: handle the whole subtree's tensors, not only the module's own.
        skip_keys: keyword arguments not moved (e.g. a cache that lives elsewhere).
        move_tensors: put the (not offloaded) tensors on `execution_device`; False only aligns the inputs (for a
            block whose submodules offload their own weights).
    """

    def __init__(self, execution_device: torch.device | int | str | None = None, offload: bool = False,
                 io_same_device: bool = False, weights_map: Mapping[str, torch.Tensor] | None = None,
                 offload_buffers: bool = False, place_submodules: bool = False,
                 skip_keys: str | list[str] | None = None, move_tensors: bool = True):  # fmt: skip
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.move_tensors = move_tensors
        self.input_device: torch.device | None = None

    def _tensors(self, module: nn.Module, include_buffers: bool) -> list[str]:
        return [name for name, _ in named_module_tensors(module, include_buffers, recurse=self.place_submodules)]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if self.execution_device is None or not (self.offload or self.move_tensors):
            return module
        if not self.offload:
            place_tied(module, self.execution_device, recurse=self.place_submodules)
            return module
        if self.weights_map is None:  # offload what the module holds now, into CPU memory
            self.weights_map = {name: tensor.detach().to("cpu") for name, tensor in
                                named_module_tensors(module, self.offload_buffers, recurse=self.place_submodules)}  # fmt: skip
        for name in self._tensors(module, include_buffers=self.offload_buffers):
            set_module_tensor_to_device(module, name, "meta")
        if not self.offload_buffers:
            for name, _ in module.named_buffers(recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            for name in self._tensors(module, include_buffers=self.offload_buffers):
                set_module_tensor_to_device(module, name, self.execution_device, value=self.weights_map[name])
        if self.execution_device is None:
            return args, kwargs
        skip = [self.skip_keys] if isinstance(self.skip_keys, str) else list(self.skip_keys or [])
        moved = {k: v if k in skip else send_to_device(v, self.execution_device) for k, v in kwargs.items()}
        return send_to_device(args, self.execution_device), moved

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._tensors(module, include_buffers=self.offload_buffers):
                set_module_tensor_to_device(module, name, "meta")
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload and self.weights_map is not None:  # give the module its weights back
            for name in self._tensors(module, include_buffers=self.offload_buffers):
                set_module_tensor_to_device(module, name, "cpu", value=self.weights_map[name])
        return module
