"""Hooks around a module's forward, and the one big-model inference needs: `AlignDevicesHook`.

`add_hook_to_module(module, hook)` replaces `module.forward` with one that calls `hook.pre_forward` (which may
change the arguments), the original forward, then `hook.post_forward` (which may change the output);
`remove_hook_from_module` puts the original back. `AlignDevicesHook` moves a module's inputs to the device it
runs on and, for an offloaded module, brings its weights in from a weights map (CPU memory or an offload
folder) just for the forward and drops them after, so the module holds only meta tensors between calls. Tied weights
offloaded under several names can share one copy on the execution device through a `tied_params_map` (storage
address -> {device: tensor}).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accel.big_modeling.sizes import named_module_tensors
from accel.memory import clear_device_cache
from accel.pytree import find_device, send_to_device
from accel.unsupported import refuse

TiedParamsMap = dict[int, dict[Any, torch.Tensor]]


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
    hooked = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if "GraphModuleImpl" in str(type(module)):  # an instance forward would freeze a torch.fx graph module's code
        type(module).forward = hooked
    else:
        module.forward = hooked
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


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Removes the hooks of `module` and of every module below it."""
    remove_hook_from_module(module, recurse=True)


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: torch.device | int | str,
    value: Any = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: TiedParamsMap | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Puts the parameter or buffer `tensor_name` ("layer.0.weight") of `module` on `device`, with `value`'s data
    when given (`param.to(device)` would make a new tensor the module does not hold).

    Args:
        module: the module holding the tensor (anywhere below it).
        tensor_name: its full name.
        device: where to put it ("meta" drops its memory).
        value: its new data (needed to leave the meta device); anything `torch.tensor` takes.
        dtype: the dtype floating-point data is converted to; by default a floating-point value takes the dtype
            the tensor had (as `load_state_dict` does), integer and bool values keep theirs.
        fp16_statistics: bitsandbytes' int8 statistics: not supported by accel (UnsupportedFeatureError).
        tied_params_map: storage address of a tied weight -> {device: the tensor already placed there}: a value (or
            current tensor) found there for `device` is reused instead of copied again, and a new copy is recorded.
        non_blocking: asynchronous copies where the device allows.
        clear_cache: empty the accelerator's memory cache after placing on it (as HF). accel's own hooks pass False:
            emptying the cache per tensor costs a device synchronization each time.

    A parameter stays a Parameter of its class, with its requires_grad and attributes; moving it where it already
    is keeps the very same object.

    Raises:
        ValueError: no such tensor, a shape that differs from the tensor's, or a meta tensor moved without a value.
    """
    if fp16_statistics is not None:
        raise refuse(
            "bitsandbytes 8-bit weights",
            "set_module_tensor_to_device(fp16_statistics=...)",
            "Load the weights in a floating-point dtype (dtype=torch.float16 or torch.bfloat16).",
        )
    owner, name = _owner_of(module, tensor_name)
    tensors = owner._buffers if name in owner._buffers else owner._parameters
    old = tensors[name]
    if value is not None and not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    shared = _already_placed(tied_params_map, device, value, old)
    if shared is not None:
        tensors[name] = shared
        return
    _check_value(tensor_name, old, value, device)
    new = old if value is None else value
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if dtype is None and value is not None and old is not None and new.is_floating_point():
        dtype = old.dtype
    with torch.no_grad():
        new = new.to(device=device, dtype=dtype if new.is_floating_point() else None, non_blocking=non_blocking)
    if new is old:
        return
    if tensors is owner._parameters:
        new = _as_parameter(new, old)
    tensors[name] = new
    if clear_cache and torch.device(device).type not in ("cpu", "meta"):
        clear_device_cache()
    _record_placed(tied_params_map, device, value, old, new)


def _owner_of(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    owner_name, _, name = tensor_name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        raise ValueError(f"{type(module).__name__} has no submodule '{owner_name}' (for '{tensor_name}')") from None
    if name not in owner._buffers and name not in owner._parameters:
        raise ValueError(f"'{tensor_name}' is neither a parameter nor a buffer of {type(module).__name__}")
    return owner, name


def _check_value(tensor_name: str, old: torch.Tensor | None, value: torch.Tensor | None, device) -> None:
    if value is None and old is not None and old.device.type == "meta" and torch.device(device).type != "meta":
        raise ValueError(f"'{tensor_name}' is on the meta device (never loaded): pass its value to place it")
    if value is not None and old is not None and value.shape != old.shape:
        raise ValueError(
            f"'{tensor_name}' has shape {list(old.shape)}: a value of shape {list(value.shape)} "
            "cannot replace it (a checkpoint of another model?)"
        )


def _as_parameter(data: torch.Tensor, old: torch.Tensor | None) -> nn.Parameter:
    """`data` as a parameter of `old`'s class, with its requires_grad and the attributes libraries set on it."""
    cls = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
    requires_grad = old.requires_grad if old is not None else False
    new = cls(data, requires_grad=requires_grad and (data.is_floating_point() or data.is_complex()))
    for attribute, attribute_value in (getattr(old, "__dict__", None) or {}).items():
        if not hasattr(new, attribute):
            setattr(new, attribute, attribute_value)
    return new


def _tied_key(tensor: torch.Tensor | None, tied_params_map: TiedParamsMap) -> int | None:
    if tensor is None or tensor.device.type == "meta":  # meta tensors have no address to tell them apart
        return None
    key = tensor.data_ptr()
    return key if key in tied_params_map else None


def _already_placed(tied_params_map: TiedParamsMap | None, device, value, old) -> torch.Tensor | None:
    """The copy of this tied weight already on `device`, if `tied_params_map` has one."""
    if tied_params_map is None:
        return None
    for tensor in (value, old) if value is not None else (old,):
        key = _tied_key(tensor, tied_params_map)
        if key is not None and device in tied_params_map[key]:
            return tied_params_map[key][device]
    return None


def _record_placed(tied_params_map: TiedParamsMap | None, device, value, old, new: torch.Tensor) -> None:
    if tied_params_map is None:
        return
    for tensor in (old, value):
        key = _tied_key(tensor, tied_params_map)
        if key is not None:
            tied_params_map[key].setdefault(device, new)
            return


def place_tied(module: nn.Module, device: torch.device | int | str, recurse: bool = True) -> None:
    """Moves the module's parameters and buffers to `device`; a parameter known under several names (tied) is
    moved once and stays one parameter under all of them."""
    by_identity: dict[int, list[str]] = {}
    for name, param in module.named_parameters(recurse=recurse, remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    for names in by_identity.values():
        set_module_tensor_to_device(module, names[0], device, clear_cache=False)
        owner_name, _, attr = names[0].rpartition(".")
        moved = (module.get_submodule(owner_name) if owner_name else module)._parameters[attr]
        for alias in names[1:]:
            owner_name, _, attr = alias.rpartition(".")
            (module.get_submodule(owner_name) if owner_name else module)._parameters[attr] = moved
    for name, _ in module.named_buffers(recurse=recurse):
        set_module_tensor_to_device(module, name, device, clear_cache=False)


class AlignDevicesHook(ModelHook):
    """Runs a module on `execution_device`: moves its inputs there and, when `offload`, loads its weights from
    `weights_map` (names relative to the module) for each forward and puts them back on meta after.

    Args:
        execution_device: where the forward runs (and where the weights are put when not offloaded).
        offload: keep the weights in `weights_map` between forwards (the module holds meta tensors).
        io_same_device: return the output on the device the first input came from.
        weights_map: name -> tensor for the offloaded weights (e.g. an OffloadedWeightsLoader); by default what
            the module holds when the hook is attached, copied to the CPU.
        offload_buffers: offload buffers too (else they are moved to `execution_device` once). Non-persistent
            buffers (not in a state dict) always stay on `execution_device`.
        place_submodules: handle the whole subtree's tensors, not only the module's own.
        skip_keys: keyword arguments not moved (e.g. a cache that lives elsewhere).
        tied_params_map: storage address -> {device: tensor} shared by the hooks of one model, so that a tied weight
            offloaded under several names is copied to the execution device once per forward, not once per name.
        move_tensors: (accel) put the (not offloaded) tensors on `execution_device`; False only aligns the inputs
            (for a block whose submodules offload their own weights).

    Removing the hook gives an offloaded module its weights back, on the device they had (the CPU for weights that
    were on the meta device, e.g. loaded straight into the offload folder; HF leaves those on meta).
    """

    def __init__(
        self,
        execution_device: torch.device | int | str | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: TiedParamsMap | None = None,
        move_tensors: bool = True,
    ):
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.move_tensors = move_tensors
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}
        self.tied_params_names: set[str] = set()
        self._placed_tied: set[tuple[int, Any]] = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded(self, module: nn.Module) -> list[str]:
        """The names this hook brings in for each forward: parameters, and persistent buffers with offload_buffers."""
        return [
            name
            for name, _ in named_module_tensors(
                module, self.offload_buffers, recurse=self.place_submodules, remove_non_persistent=True
            )
        ]

    def init_hook(self, module: nn.Module) -> nn.Module:
        if str(self.execution_device) == "meta":  # meta tensors have no address to share tied weights by
            self.tied_params_map = None
        if self.execution_device is None or not (self.offload or self.move_tensors):
            return module
        if not self.offload:
            place_tied(module, self.execution_device, recurse=self.place_submodules)
            return module
        self._offload(module)
        return module

    def _offload(self, module: nn.Module) -> None:
        names = self._offloaded(module)
        self.original_devices = {
            name: tensor.device for name, tensor in named_module_tensors(module, recurse=self.place_submodules)
        }
        if self.weights_map is None:  # offload what the module holds now, into CPU memory
            tensors = dict(named_module_tensors(module, recurse=self.place_submodules))
            self.weights_map = {name: tensors[name].detach().to("cpu") for name in names}
        for name in names:
            if (
                self.tied_params_map is not None
                and _tied_key(_get_tensor(module, name), self.tied_params_map) is not None
            ):
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta")
        on_device = [name for name, _ in module.named_buffers(recurse=self.place_submodules) if name not in names]
        for name in on_device:  # buffers not offloaded (all, or the non-persistent ones) live where the forward runs
            set_module_tensor_to_device(module, name, self.execution_device, clear_cache=False)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            for name in self._offloaded(module):
                self._bring_in(module, name)
        if self.execution_device is None:
            return args, kwargs
        skip = [self.skip_keys] if isinstance(self.skip_keys, str) else list(self.skip_keys or [])
        moved = {k: v if k in skip else send_to_device(v, self.execution_device) for k, v in kwargs.items()}
        return send_to_device(args, self.execution_device), moved

    def _bring_in(self, module: nn.Module, name: str) -> None:
        value = self.weights_map[name]
        tied = self.tied_params_map
        if tied is not None and name in self.tied_params_names and value.data_ptr() not in tied:
            tied[value.data_ptr()] = {}  # the weights map's tensor is the one the other names share
        if tied is not None and value.data_ptr() in tied and self.execution_device not in tied[value.data_ptr()]:
            self._placed_tied.add((value.data_ptr(), self.execution_device))  # this hook placed it: it drops it
        set_module_tensor_to_device(
            module, name, self.execution_device, value=value, tied_params_map=tied, clear_cache=False
        )

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name in self._offloaded(module):
                set_module_tensor_to_device(module, name, "meta")
            for key, device in self._placed_tied:  # let the copy on the execution device be freed
                self.tied_params_map.get(key, {}).pop(device, None)
            self._placed_tied = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload and self.weights_map is not None:  # give the module its weights back
            for name in self._offloaded(module):
                device = self.original_devices.get(name, torch.device("cpu"))
                device = "cpu" if device.type == "meta" else device
                set_module_tensor_to_device(module, name, device, value=self.weights_map[name], clear_cache=False)
        return module


def _get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return owner._parameters[attribute] if attribute in owner._parameters else owner._buffers[attribute]
