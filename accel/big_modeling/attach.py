"""Attaching `AlignDevicesHook`s to a model's modules (HF's building blocks of `cpu_offload` / `dispatch_model`), and
working with a module whose weights a hook offloads: `has_offloaded_params`, `align_module_device`.

`attach_align_device_hook` hooks every module that owns tensors (each brings in its own weights for its forward);
`attach_execution_device_hook` only aligns inputs and places weights; `attach_align_device_hook_on_blocks` does
either per block of a {block name: device} / {block name: offload} map.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from accel.big_modeling.hooks import (
    AlignDevicesHook,
    SequentialHook,
    TiedParamsMap,
    add_hook_to_module,
    set_module_tensor_to_device,
)
from accel.big_modeling.offload import PrefixedDataset
from accel.big_modeling.sizes import named_module_tensors

Device = torch.device | int | str


def _is_preloaded(module: nn.Module, preload_module_classes: list[str] | None) -> bool:
    return preload_module_classes is not None and type(module).__name__ in preload_module_classes


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: Device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Hooks every module below `module` (itself included) that holds tensors and has no hook yet, so that its
    inputs and tensors are on `execution_device` for its forward. Stops below a module of `preload_module_classes`."""
    if not hasattr(module, "_hf_hook") and next(iter(module.state_dict(keep_vars=True)), None) is not None:
        add_hook_to_module(
            module, AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        )
    if _is_preloaded(module, preload_module_classes):
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: Device | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Hooks (appending to existing hooks) every module below `module` that owns parameters or buffers with an
    `AlignDevicesHook`: with `offload`, each brings its own weights in from `weights_map` (names from the root
    model; `module_name` is `module`'s name there) for its forward only.

    A module of `preload_module_classes` brings in the weights of its whole subtree at once instead (for modules
    that use a child's weights without calling the child).
    """
    preload = offload and _is_preloaded(module, preload_module_classes)
    if preload or next(named_module_tensors(module), None) is not None:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=None if weights_map is None else PrefixedDataset(weights_map, prefix),
            offload_buffers=offload_buffers,
            place_submodules=preload,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if preload:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
        )


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: Device | Mapping[str, Device] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: TiedParamsMap | None = None,
) -> None:
    """Hooks the blocks of `module` as `execution_device` and `offload` say, each either one value for the whole
    module or a {block name: value} map (names from the root model).

    A block that is not offloaded gets one hook placing its whole subtree on its device; an offloaded block gets
    `attach_align_device_hook`'s per-module hooks. The root gets a hook returning the output where the input was.
    """
    common = {"skip_keys": skip_keys, "tied_params_map": tied_params_map}
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attach_align_device_hook(
                module, execution_device, True, weights_map, offload_buffers, module_name, **common
            )
        else:
            add_hook_to_module(
                module, AlignDevicesHook(execution_device, io_same_device=True, place_submodules=True, **common)
            )
        return
    if not isinstance(execution_device, Mapping):
        execution_device = dict.fromkeys(offload, execution_device)
    if not isinstance(offload, Mapping):
        offload = dict.fromkeys(execution_device, offload)
    if module_name in execution_device and module_name in offload:
        _hook_block(
            module,
            execution_device[module_name],
            offload[module_name],
            weights_map,
            offload_buffers,
            module_name,
            preload_module_classes,
            common,
        )
    elif module_name == "":
        add_hook_to_module(module, AlignDevicesHook(execution_device.get(""), io_same_device=True, **common))
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{child_name}" if module_name else child_name,
            preload_module_classes=preload_module_classes,
            **common,
        )


def _hook_block(
    module: nn.Module,
    device: Device,
    offload: bool,
    weights_map,
    offload_buffers: bool,
    module_name: str,
    preload_module_classes: list[str] | None,
    common: dict,
) -> None:
    if not offload:
        add_hook_to_module(
            module,
            AlignDevicesHook(
                device,
                offload_buffers=offload_buffers,
                io_same_device=module_name == "",
                place_submodules=True,
                **common,
            ),
        )
        attach_execution_device_hook(module, device, **common)
        return
    attach_align_device_hook(
        module,
        device,
        True,
        weights_map,
        offload_buffers,
        module_name,
        preload_module_classes=preload_module_classes,
        **common,
    )
    if not hasattr(module, "_hf_hook"):
        add_hook_to_module(module, AlignDevicesHook(device, io_same_device=module_name == "", **common))
    attach_execution_device_hook(module, device, preload_module_classes=preload_module_classes, **common)


def offload_hook(module: nn.Module) -> AlignDevicesHook | None:
    """The hook that offloads `module`'s weights, also when it is one of a chain (accel's dispatch appends hooks)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    return next((h for h in hooks if isinstance(h, AlignDevicesHook) and h.offload), None)


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether a hook keeps `module`'s weights offloaded (they are brought in only for its forward).

    HF looks only at a hook of its own class; accel also finds one in a chain of hooks (`SequentialHook`)."""
    return offload_hook(module) is not None


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: Device | None = None) -> Iterator[None]:
    """Inside, `module`'s weights are loaded: an offloaded module's are brought in (to `execution_device` when given,
    else where its forward runs) and dropped after; otherwise its own parameters are moved to `execution_device`
    for the duration (nothing happens without one)."""
    hook = offload_hook(module)
    if hook is not None:
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
        return
    if execution_device is None:
        yield
        return
    devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
    try:
        for name in devices:
            set_module_tensor_to_device(module, name, execution_device, clear_cache=False)
        yield
    finally:
        for name, device in devices.items():
            set_module_tensor_to_device(module, name, device, clear_cache=False)
