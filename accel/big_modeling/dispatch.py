"""Running a model spread over devices: `dispatch_model`, `cpu_offload`, `disk_offload` and
`load_checkpoint_and_dispatch`.

A device map entry on a GPU (or on "cpu" when the CPU is where the model runs) puts that module there; an
entry on "cpu" while a GPU runs the model, or on "disk", offloads it: its weights stay in CPU memory or in the
offload folder and come to the execution device only for its forward (AlignDevicesHook). The model's output
comes back on the device of its input.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Mapping

import torch
from torch import nn

from accel.big_modeling.attach import attach_align_device_hook
from accel.big_modeling.device_map import Device, get_balanced_memory, infer_auto_device_map
from accel.big_modeling.hooks import AlignDevicesHook, add_hook_to_module, set_module_tensor_to_device
from accel.big_modeling.offload import (
    OffloadedWeightsLoader,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from accel.big_modeling.tied import tied_groups
from accel.checkpoint import leased_mapping
from accel.checkpoint.model_io import checkpoint_files, is_safetensors
from accel.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from accel.unsupported import refuse

logger = logging.getLogger(__name__)
OFFLOADED = ("cpu", "disk")


def _torch_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def device_for(device_map: Mapping[str, Device], tensor_name: str) -> Device | None:
    """The device of a tensor: the entry of the longest prefix of its name ("" is the whole model)."""
    best = None
    for name in device_map:
        if (name == "" or tensor_name == name or tensor_name.startswith(name + ".")) and (
            best is None or len(name) > len(best)
        ):
            best = name
    return None if best is None else device_map[best]


def check_device_map(model: nn.Module, device_map: Mapping[str, Device]) -> None:
    """Raises ValueError unless every entry names a module or tensor of `model` and every parameter gets a device.

    HF only warns about entries that name nothing in the model; accel refuses them, since such an entry is usually
    a misspelled module name whose weights would otherwise land on another device without a word."""
    known = {name for name, _ in model.named_modules()}
    known |= {name for name, _ in model.named_parameters(remove_duplicate=False)}
    known |= {name for name, _ in model.named_buffers()}
    unknown = [name for name in device_map if name not in known]
    if unknown:
        raise ValueError(f"device_map names what the model does not have: {', '.join(unknown)}")
    uncovered = [n for n, _ in model.named_parameters() if device_for(device_map, n) is None]
    if uncovered:
        raise ValueError(
            f"device_map gives no device to {', '.join(uncovered[:5])}{'...' if len(uncovered) > 5 else ''}"
        )


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: dict | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Places `model` as `device_map` says and hooks it so that a forward runs across the devices.

    Weights of modules on "disk" are written to `offload_dir` (unless `offload_index` says they already are);
    `state_dict`, when given, holds the CPU-offloaded weights (else they are taken from the model). An offloaded
    module of a class in `preload_module_classes` brings in its whole subtree's weights for its forward (for
    modules that use a child's weights without calling the child); other offloaded modules bring in their own.
    """
    check_device_map(model, device_map)
    if main_device is None:
        placed = [d for d in device_map.values() if d not in OFFLOADED]
        main_device = placed[0] if placed else "cpu"
    devices = set(device_map.values())
    if len(devices) == 1 and "disk" not in devices and not force_hooks:
        model.to(_torch_device(next(iter(devices))))
        model.hf_device_map = dict(device_map)
        return model
    modules = {name for name, _ in model.named_modules()}
    offloaded = {
        name: device
        for name, device in device_map.items()
        if name in modules and (device == "disk" or (device == "cpu" and main_device != "cpu"))
    }
    return _attach_hooks(
        model,
        device_map,
        main_device,
        offloaded,
        state_dict,
        offload_dir,
        offload_index,
        offload_buffers,
        skip_keys,
        preload_module_classes,
    )


def _attach_hooks(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device,
    offloaded: Mapping[str, Device],
    state_dict,
    offload_dir,
    offload_index,
    offload_buffers: bool,
    skip_keys,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    weights = _offloaded_weights(model, offloaded, state_dict, offload_dir, offload_index, offload_buffers)
    # First, so that it sees the caller's input device before any other hook moves the input.
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True, skip_keys=skip_keys), append=True)
    modules = {name for name, _ in model.named_modules()}
    for name, device in device_map.items():
        if name not in modules:  # a tensor of a split module: it lives where its module runs
            set_module_tensor_to_device(
                model, name, _torch_device(main_device if name in offloaded else device), clear_cache=False
            )
            continue
        entry = _module_of(model, name)
        execution = _torch_device(main_device if name in offloaded else device)
        # The entry aligns its inputs (a block's residual must meet its output on one device) and, unless
        # offloaded, holds its tensors on its device.
        add_hook_to_module(
            entry,
            AlignDevicesHook(
                execution_device=execution,
                place_submodules=True,
                skip_keys=skip_keys,
                move_tensors=name not in offloaded,
            ),
            append=True,
        )
        if name in offloaded:  # every submodule owning weights brings them in for its own forward only
            attach_align_device_hook(
                entry,
                execution,
                offload=True,
                weights_map=weights,
                offload_buffers=offload_buffers,
                module_name=name,
                skip_keys=skip_keys,
                preload_module_classes=preload_module_classes,
            )
    model.hf_device_map = dict(device_map)
    return model


def _module_of(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"device_map entry '{name}' is not a module; place tensors through their module") from None


def _offloaded_weights(
    model: nn.Module, offloaded: Mapping[str, Device], state_dict, offload_dir, offload_index, offload_buffers: bool
) -> OffloadedWeightsLoader:
    """The weights map of every offloaded module: CPU tensors, plus the disk ones in the offload folder."""
    tensors = dict(model.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    if offload_buffers:
        tensors.update(model.named_buffers())
    under = {device: [n for n in tensors if device_for(offloaded, n) == device] for device in ("cpu", "disk")}
    cpu_weights = {
        n: (state_dict[n] if state_dict is not None and n in state_dict else tensors[n].detach().cpu())
        for n in under["cpu"]
    }
    folder = None if offload_dir is None else os.fspath(offload_dir)
    if under["disk"]:
        if folder is None:
            raise ValueError(
                "We need an `offload_dir` to dispatch this model according to this `device_map`, the "
                f"following submodules need to be offloaded: {_on_disk(offloaded)}."
            )
        offload_index = dict(offload_index or {})
        missing = {n: tensors[n] for n in under["disk"] if n not in offload_index}
        unloaded = [n for n, t in missing.items() if t.device.type == "meta"]
        if unloaded:
            raise ValueError(
                f"cannot offload {', '.join(unloaded[:5])}: on the meta device and not in the offload index"
            )
        if missing:
            offload_index.update(offload_state_dict(folder, missing))
    return OffloadedWeightsLoader(state_dict=cpu_weights, save_folder=folder, index=offload_index)


def _first_device(model: nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def cpu_offload(
    model: nn.Module,
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keeps all of `model`'s weights in CPU memory (`state_dict`, else what the model holds) and brings each
    module's in for its forward only, on `execution_device` (default: where the model's first parameter is, as
    HF). `preload_module_classes`: as `dispatch_model`."""
    execution_device = execution_device if execution_device is not None else _first_device(model)
    device_map = {"": "cpu"}  # offloaded even when the CPU also runs it: the weights live only in the map
    return _attach_hooks(
        model,
        device_map,
        execution_device,
        device_map,
        state_dict,
        None,
        None,
        offload_buffers,
        None,
        preload_module_classes,
    )


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: Device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Writes all of `model`'s weights to `offload_dir` and brings each module's in (memory-mapped) for its forward,
    on `execution_device` (default: where the model's first parameter is, as HF).

    A folder that already holds an offload index (`index.json`) is used as it is: the weights it names are not
    written again (HF's behaviour; pass a new folder for a new model)."""
    execution_device = execution_device if execution_device is not None else _first_device(model)
    index_file = os.path.join(os.fspath(offload_dir), "index.json")
    index = None
    if os.path.isfile(index_file):
        with open(index_file) as f:
            index = json.load(f)
    return dispatch_model(
        model,
        {"": "disk"},
        main_device=execution_device,
        offload_dir=offload_dir,
        offload_index=index,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
        force_hooks=True,
    )


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | Mapping[str, Device] | None = None,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Loads `checkpoint` (a file, a sharded index or a folder; safetensors or .bin) into `model` (usually built
    under `init_empty_weights`) and dispatches it over the devices.

    `device_map`: "auto" / "balanced" / "balanced_low_0" (spread evenly over the GPUs; low_0 keeps GPU 0 light),
    "sequential" (fill each device in turn), an explicit {name: device}, or None (the default, as HF): everything
    on the CPU and no hooks. A computed map sends what `max_memory` leaves over to "disk", as HF's does (then
    `offload_folder` is required: ValueError before anything is loaded). Each tensor is read once, shard by
    shard, straight to its device, or (for "disk") into the offload folder, so peak host memory stays near what
    lives on the CPU plus one tensor. Every safetensors file is opened once and read through that descriptor, so a
    checkpoint replaced while it loads is read as it was validated (rewritten in place: FileChangedError).
    Weights served from the CPU in the file's dtype are not copied at all: they are views of a private
    (copy-on-write) mapping of the safetensors file, pre-faulted while loading, sharing the page cache; writing to
    them never reaches the file. The mapping holds a read lease: before anyone rewrites or truncates the file in
    place, the weights are copied into private memory, so they never change underneath (details and limits:
    accel.checkpoint.leased_mapping; where no lease can be taken, or with ACCEL_MAP_CHECKPOINTS=0, weights are
    copied while loading). `offload_state_dict` is accepted for compatibility: tensors are loaded one at a time
    anyway. `preload_module_classes`: as `dispatch_model`. `full_state_dict` only concerns models whose
    parameters are DTensors (FSDP2), which accel does not create; `broadcast_from_rank0=True` (rank 0 reads and
    broadcasts) is not supported: UnsupportedFeatureError.
    """
    if broadcast_from_rank0:
        raise refuse(
            "Loading on rank 0 and broadcasting (FSDP2)",
            "load_checkpoint_and_dispatch(broadcast_from_rank0=True)",
            "Let every process load the checkpoint: accel maps safetensors files, so processes on one machine "
            "share one copy in the page cache.",
        )
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    dispatch = device_map is not None
    device_map = _resolve_device_map(model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers)
    check_device_map(model, device_map)
    folder = None if offload_folder is None else os.fspath(offload_folder)
    if "disk" in device_map.values():
        if folder is None:  # before anything is loaded, as HF
            raise ValueError(
                f"At least one of the model submodule will be offloaded to disk ({_on_disk(device_map)}), "
                "please pass along an `offload_folder`."
            )
        os.makedirs(folder, exist_ok=True)
    index = _load_routed(model, checkpoint, device_map, folder, dtype, strict, offload_buffers)
    if folder is not None and index:
        save_offload_index(index, folder)
    if not dispatch:
        return model
    return dispatch_model(
        model,
        device_map,
        offload_dir=folder,
        offload_index=index or None,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


def _on_disk(device_map: Mapping[str, Device]) -> str:
    return ", ".join(name or "''" for name, device in device_map.items() if device == "disk")


def _resolve_device_map(model, device_map, max_memory, no_split, dtype, offload_buffers: bool) -> dict[str, Device]:
    if device_map is None:
        return {"": "cpu"}
    if not isinstance(device_map, str):
        return dict(device_map)
    if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map={device_map!r}: use 'auto', 'balanced', 'balanced_low_0', 'sequential' or a dict")
    if device_map != "sequential":
        max_memory = get_balanced_memory(model, max_memory, no_split, dtype, low_zero=device_map == "balanced_low_0")
    return dict(
        infer_auto_device_map(
            model, max_memory, no_split_module_classes=no_split, dtype=dtype, offload_buffers=offload_buffers
        )
    )


def _load_routed(
    model: nn.Module,
    checkpoint,
    device_map: Mapping[str, Device],
    folder: str | None,
    dtype: torch.dtype | None,
    strict: bool,
    offload_buffers: bool,
) -> dict:
    """Reads every tensor once to where the device map sends it; returns the offload index of the disk ones.

    Every safetensors file is opened once: its header is validated (all of them before anything is loaded) and its
    data read through that same descriptor, so a checkpoint replaced meanwhile is read as it was validated."""
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    buffers = {name for name, _ in model.named_buffers()} if not offload_buffers else set()
    persistent = set(model.state_dict(keep_vars=True))  # buffers a checkpoint holds (not e.g. rotary tables)
    tied = tied_groups(model)  # before loading replaces the parameters that make them one
    first_name = {alias: group[0] for group in tied for alias in group}  # a file may hold any one alias
    index: dict = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(checkpoint)
    with contextlib.ExitStack() as stack:
        opened = {path: stack.enter_context(SafetensorsFile(path)) for path in files if is_safetensors(path)}
        _check_shapes(own, {path: f.header for path, f in opened.items()})
        for path in files:
            state = _tensors_of(opened[path], own, device_map, dtype) if path in opened else _load_bin(path).items()
            for saved_name, value in state:
                name = first_name.get(saved_name, saved_name)
                if name not in own:
                    unexpected.append(saved_name)
                elif name not in seen:
                    seen.add(name)
                    _route(model, name, value(), own[name], device_map, folder, dtype, index, path, name in buffers)
    aliases = {name for group in tied for name in group}
    _report(
        {n: t for n, t in own.items() if n in persistent},
        seen,
        tied,
        [n for n in unexpected if n not in aliases],
        strict,
        checkpoint,
    )
    _retie(model, tied, index, folder)
    return index


def _tensors_of(file: SafetensorsFile, own: dict, device_map: Mapping[str, Device], dtype: torch.dtype | None):
    """(name, a function giving the tensor) for every tensor of `file`, in file order: views of the file's leased
    mapping where weights are served from the CPU in the file's dtype (see accel.checkpoint.leased_mapping), else
    read through the file's descriptor, one tensor at a time."""
    mapped = leased_mapping.map_file(file) if _maps_here(file.header, own, device_map, dtype) else None
    for saved_name, info in file.header.tensors.items():
        yield saved_name, functools.partial(_read_one, file, info, mapped)


def _read_one(file: SafetensorsFile, info, mapped: torch.Tensor | None) -> torch.Tensor:
    value = _view(mapped, info) if mapped is not None else None
    if value is None:
        value = torch.empty(info.shape, dtype=info.dtype)
        file.read_into({info.name: value})
    return value


def _maps_here(header, own: dict, device_map: Mapping[str, Device], dtype: torch.dtype | None) -> bool:
    """Whether any tensor of this file is served from the CPU in its own dtype (then the file is mapped)."""
    for name, info in header.tensors.items():
        if name in own and device_for(device_map, name) == "cpu":
            wanted = dtype if (dtype is not None and info.dtype.is_floating_point) else own[name].dtype
            if not info.dtype.is_floating_point or wanted == info.dtype:
                return True
    return False


def _view(mapped: torch.Tensor, info) -> torch.Tensor | None:
    """The tensor as a view of the mapped file: no copy (None when its offset is not aligned to its dtype)."""
    element = torch.empty((), dtype=info.dtype).element_size()
    if info.begin % element or info.nbytes == 0:
        return None
    return mapped[info.begin : info.end].view(info.dtype).view(info.shape)


def _check_shapes(own: dict[str, torch.Tensor], headers: dict) -> None:
    """Before anything is loaded: the model's first tensor (in its own order) whose shape the checkpoint
    contradicts, named."""
    saved = {name: (header.path, info.shape) for header in headers.values() for name, info in header.tensors.items()}
    for name, tensor in own.items():
        if name in saved and saved[name][1] != tuple(tensor.shape):
            raise CheckpointError(
                f"'{saved[name][0]}', tensor '{name}': the checkpoint has shape {list(saved[name][1])}, "
                f"the model {list(tensor.shape)}: a checkpoint of another architecture?"
            )


def _retie(model: nn.Module, tied: list[list[str]], index: dict, folder: str | None) -> None:
    """Makes every name of a tied group one parameter again (loading replaced the first); a tied weight on disk
    gets an entry under each name, as the offloaded modules look their weights up by name."""
    for names in tied:
        first = names[0]
        owner_name, _, attr = first.rpartition(".")
        param = (model.get_submodule(owner_name) if owner_name else model)._parameters[attr]
        for other in names[1:]:
            if first in index:
                offload_weight(
                    load_offloaded_weight(os.path.join(folder, f"{first}.dat"), index[first]), other, folder, index
                )
            owner_name, _, attr = other.rpartition(".")
            (model.get_submodule(owner_name) if owner_name else model)._parameters[attr] = param


def _load_bin(path: str) -> dict:
    """A .bin state dict as (name, a function giving the tensor), read (weights_only) through one descriptor. Not
    mapped: torch.load's mapping could not be guarded against in-place writers (see leased_mapping)."""
    with open(path, "rb") as f:
        state_dict = torch.load(f, map_location="cpu", weights_only=True)
    return {name: (lambda tensor=tensor: tensor) for name, tensor in state_dict.items()}


def _route(model, name, value, current, device_map, folder, dtype, index, path, keep_on_cpu: bool = False) -> None:
    if tuple(value.shape) != tuple(current.shape):
        raise CheckpointError(
            f"'{path}', tensor '{name}': the checkpoint has shape {list(value.shape)}, the model "
            f"{list(current.shape)}: a checkpoint of another architecture?"
        )
    target_dtype = (
        dtype
        if (dtype is not None and value.is_floating_point())
        else (current.dtype if value.is_floating_point() else value.dtype)
    )
    device = device_for(device_map, name)
    if device == "disk" and keep_on_cpu:  # a buffer without offload_buffers: its hook moves it where it runs
        device = "cpu"
    if device == "disk":
        offload_weight(value.to(target_dtype), name, folder, index)
        set_module_tensor_to_device(model, name, "meta", dtype=target_dtype)
    else:
        set_module_tensor_to_device(
            model,
            name,
            "cpu" if device == "cpu" else _torch_device(device),
            value=value,
            dtype=target_dtype,
            clear_cache=False,
        )


def _report(own: dict, seen: set[str], tied: list[list[str]], unexpected: list[str], strict: bool, checkpoint) -> None:
    aliases = {name: group for group in tied for name in group}
    missing = [n for n in own if n not in seen and not any(t in seen for t in aliases.get(n, []))]
    if not missing and not unexpected:
        return
    parts = [f"missing from the checkpoint: {', '.join(missing)}"] if missing else []
    parts += [f"in the checkpoint but not in the model: {', '.join(unexpected)}"] if unexpected else []
    message = f"loading '{os.fspath(checkpoint)}': " + "; ".join(parts)
    if strict:
        raise CheckpointError(message)
    logger.warning(message)
