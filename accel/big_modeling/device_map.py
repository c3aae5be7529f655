"""Where each part of a model goes: `get_max_memory`, `get_balanced_memory`, `infer_auto_device_map`.

A device map is {module or tensor name: device}, devices being GPU indices, "cpu" or "disk", filled in that
order: GPUs first, then CPU RAM, then the disk, which `infer_auto_device_map` always adds and never runs out of
(as HF Accelerate: a model too large for the memory given is offloaded, never refused). It walks the model's
modules in order and puts each on the current device while it fits; a module that does not fit is split into its
children, unless it is a leaf or its class is in `no_split_module_classes` (a transformer block, whose residual
connections must run on one device), in which case the next device is tried. The main devices (the first GPU and
the CPU, or the CPU alone) keep room for the largest layer not placed yet, as an offloaded layer is brought there
for its forward. Modules holding a weight tied to the one being placed go with it (tied weights are one tensor).
The maps are HF Accelerate 1.15's for the same model and memory.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from accel.big_modeling.sizes import compute_module_sizes, compute_module_total_buffer_size, get_max_layer_size
from accel.big_modeling.tied import check_tied_parameters_in_config, find_tied_parameters
from accel.checkpoint.model_io import parse_size

logger = logging.getLogger(__name__)

Device = int | str


def convert_file_size_to_int(size: int | str) -> int:
    """`"10GiB"` -> 10737418240, `"2GB"` -> 2000000000, an int as it is (accel.checkpoint.parse_size)."""
    return parse_size(size, what="max_memory")


def _device_order(device: Device) -> tuple[int, int]:
    if isinstance(device, int):
        return 0, device
    return {"mps": (1, 0), "cpu": (2, 0), "disk": (3, 0)}[device]


def check_device_same(first_device: torch.device, second_device: torch.device) -> bool:
    """Whether two devices are one: `cuda` and `cuda:0` are (torch says they differ)."""
    if first_device.type != second_device.type:
        return False
    if first_device.type == "cpu":
        return True
    return (first_device.index or 0) == (second_device.index or 0)


def get_max_memory(max_memory: dict[Device, int | str] | None = None) -> dict[Device, int]:
    """Bytes available per device, GPUs (by index) first, then "mps", "cpu", "disk".

    Without `max_memory`: 90% of the free memory of every visible GPU, and the available RAM.
    """
    if max_memory is None:
        import psutil

        found: dict[Device, int] = {}
        for index in range(torch.cuda.device_count()):  # 90%: room for activations and caches
            found[index] = int(torch.cuda.mem_get_info(index)[0] * 0.9)
        found["cpu"] = psutil.virtual_memory().available
        return found
    unknown = [d for d in max_memory if not (isinstance(d, int) and d >= 0) and d not in ("mps", "cpu", "disk")]
    if unknown:
        raise ValueError(f"max_memory: unknown device(s) {unknown}; use GPU indices, 'mps', 'cpu' or 'disk'")
    return {d: convert_file_size_to_int(max_memory[d]) for d in sorted(max_memory, key=_device_order)}


def _no_split(module: nn.Module, no_split_module_classes: set[str] | list[str]) -> bool:
    return type(module).__name__ in no_split_module_classes


def _units(model: nn.Module, no_split: set[str]) -> list[tuple[str, nn.Module]]:
    """The modules the placement can move as one piece: no-split modules and leaves."""
    found, stack = [], [("", model)]
    while stack:
        name, module = stack.pop()
        children = list(module.named_children())
        if not children or _no_split(module, no_split):
            found.append((name, module))
            continue
        stack.extend((f"{name}.{child}" if name else child, sub) for child, sub in reversed(children))
    return found


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """`max_memory` with every GPU's share cut to an even part of the model (plus room for its largest
    unsplittable module), so that `infer_auto_device_map` spreads it instead of filling GPU 0 first.
    `low_zero`: GPU 0 gets as little as possible (it often also runs the generation loop)."""
    max_memory = get_max_memory(max_memory)
    gpus = [d for d in max_memory if isinstance(d, int)]
    if len(gpus) < 2:
        return max_memory
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    no_split = set(no_split_module_classes or [])
    largest = max((sizes.get(name, 0) for name, _ in _units(model, no_split)), default=0)
    shared = gpus[1:] if low_zero else gpus
    per_gpu = -(-sizes[""] // len(shared)) + largest
    balanced = dict(max_memory)
    for gpu in shared[:-1]:  # the last GPU keeps all its room: rounding leftovers go there, not to the CPU
        balanced[gpu] = min(max_memory[gpu], per_gpu)
    if low_zero:
        balanced[gpus[0]] = min(max_memory[gpus[0]], largest)
    return balanced


def _owns(module_name: str, tensor_name: str) -> bool:
    return module_name == "" or tensor_name == module_name or tensor_name.startswith(module_name + ".")


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> OrderedDict[str, Device]:
    """{module or tensor name: device} placing `model` on the devices of `max_memory` in order, then on "disk"
    (module docstring). The disk has no limit, so every model gets a map.

    Args:
        verbose: log (INFO) each placement decision.
        clean_result: merge the entries of a module that all name one device into one entry ("" for the model).
        offload_buffers: the buffers of modules placed on "cpu" / "disk" will be offloaded with them; without it they
            will live on the execution device, and a warning says when no GPU has room for them.
        fallback_allocation: a device on which the next module does not fit (and cannot be split) gets the first
            smaller module found breadth-first among the rest (`fallback_allocate`) instead of staying empty.
    """
    planner = _Planner(model, max_memory, no_split_module_classes, dtype, special_dtypes, verbose)
    while planner.pending:
        planner.place_next(offload_buffers, fallback_allocation)
    placed = clean_device_map(planner.placed) if clean_result else planner.placed
    if not offload_buffers:
        planner.warn_if_offloaded_buffers_fit_no_gpu()
    planner.log_devices_left_empty()
    return placed


class _Planner:
    """The state of one `infer_auto_device_map` walk, as HF Accelerate 1.15 keeps it (the same maps for the same
    model and memory): the entries still to place (the model's own tensors and children; a module that does not fit
    is replaced by its own tensors and children), the device being filled, and the room kept on the main devices
    (the first GPU and the CPU, or "mps", or the CPU alone) for the largest layer not placed yet, which an offloaded
    layer needs there for its forward."""

    def __init__(self, model: nn.Module, max_memory, no_split_module_classes, dtype, special_dtypes, verbose: bool):
        self.max_memory = get_max_memory(max_memory)
        self.devices: list[Device] = [*self.max_memory, *(["disk"] if "disk" not in self.max_memory else [])]
        self.gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        self.main_devices = ["mps"] if "mps" in self.gpus else [self.gpus[0], "cpu"] if self.gpus else ["cpu"]
        self.no_split = (
            [no_split_module_classes]
            if isinstance(no_split_module_classes, str)
            else list(no_split_module_classes or [])
        )
        self.dtype, self.special_dtypes, self.verbose = dtype, special_dtypes, verbose
        self.sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
        self.tied = find_tied_parameters(model)
        if not self.tied and check_tied_parameters_in_config(model):
            logger.warning(
                "The model weights are not tied. Please use the `tie_weights` method before using the "
                "`infer_auto_device` function."
            )
        self.pending: list[tuple[str, nn.Module | torch.Tensor]] = [
            *model.named_parameters(recurse=False),
            *model.named_children(),
            *model.named_buffers(recurse=False),
        ]
        self.placed: OrderedDict[str, Device] = OrderedDict()
        self.current = 0
        self.used = dict.fromkeys(self.devices, 0)
        self.buffer_bytes: dict[Device, int] = {}
        self.left_empty: dict[Device, int] = {}  # device -> bytes its first module needed
        self.largest, self.largest_names = get_max_layer_size(self.pending, self.sizes, self.no_split)

    def _update_largest_layer(self) -> None:
        """The largest layer among the pending modules (the model's own tensors count only at the start, as HF)."""
        modules = [(n, m) for n, m in self.pending if isinstance(m, nn.Module)]
        self.largest, self.largest_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _log(self, message: str, *args: Any) -> None:
        if self.verbose:
            logger.info(message, *args)

    def place_next(self, offload_buffers: bool, fallback_allocation: bool) -> None:
        """Places the first pending entry (with the modules tied to it), or splits it or one of its tied modules,
        or moves on to the next device."""
        name, module = self.pending.pop(0)
        # The room kept shrinks once every layer of the largest size has been placed.
        self.largest_names = [n for n in self.largest_names if not _owns(name, n)]
        if not self.largest_names:
            self._update_largest_layer()
        size = self.sizes.get(name, 0)
        tied_outside = [
            t
            for group in self.tied
            if any(_owns(name, t) for t in group) and not all(_owns(name, t) for t in group)
            for t in group
            if not _owns(name, t)
        ]
        device = self.devices[self.current]
        reserved = self.largest if device in self.main_devices else 0
        room = None if device == "disk" else self.max_memory[device] - reserved - self.used[device]
        with_ties, tied_names, tied_modules = get_module_size_with_ties(tied_outside, size, self.sizes, self.pending)
        if room is None or with_ties <= room:
            self._place(name, module, device, with_ties, tied_names, offload_buffers)
            return
        if tied_outside and size <= room and self._split_a_tied_module(name, module, tied_names, tied_modules):
            return
        if size >= room and self._split(name, module, device, room):
            return
        if fallback_allocation and self.used[device] == 0 and device != "disk":
            limit = self.max_memory[device] - max(self.largest, with_ties)
            found, found_module, rest = fallback_allocate(self.pending, self.sizes, limit, self.no_split, self.tied)
            if found is not None:  # placed on this device next; the entry that did not fit comes after it
                self.pending = [(found, found_module), (name, module), *rest]
                return
        if self.used[device] == 0:
            self.left_empty[device] = with_ties + reserved
        self._log(
            "'%s' (%d bytes) does not fit on %s (%d bytes used): next device", name, size, device, self.used[device]
        )
        self.used[device] += reserved
        self.current += 1
        self.pending.insert(0, (name, module))

    def _place(self, name: str, module, device: Device, size: int, tied_names: list[str], offload_buffers: bool):
        self._log("'%s' (%d bytes, with %s tied to it) -> %s", name, size, tied_names or "nothing", device)
        self.used[device] += size
        self.placed[name] = device
        for tied_name in tied_names:  # a tied weight is one tensor: its modules go where it goes
            self.pending = [(n, m) for n, m in self.pending if n != tied_name]
            self.placed[tied_name] = device
        if not offload_buffers and isinstance(module, nn.Module):
            buffers = compute_module_total_buffer_size(module, dtype=self.dtype, special_dtypes=self.special_dtypes)
            self.buffer_bytes[device] = self.buffer_bytes.get(device, 0) + buffers

    def _split_a_tied_module(self, name: str, module, tied_names: list[str], tied_modules: list) -> bool:
        """The entry fits without the modules tied to it: splits the first of them that can be split (the entry is
        tried again, with only the part holding the tied weight to take along)."""
        for tied_name, tied_module in zip(tied_names, tied_modules):
            if not _splittable(tied_module, self.no_split):
                continue
            self._log("'%s' and its tied modules do not fit: splitting '%s'", name, tied_name)
            index = next(i for i, (n, _) in enumerate(self.pending) if n == tied_name)
            self.pending = [
                (name, module),
                *self.pending[:index],
                *_parts(tied_name, tied_module),
                *self.pending[index + 1 :],
            ]
            self._update_largest_layer()
            return True
        return False

    def _split(self, name: str, module, device: Device, room: int) -> bool:
        """Replaces the entry by its own tensors and children, unless it is a tensor, a leaf or a no-split module."""
        if not _splittable(module, self.no_split):
            return False
        self._log(
            "'%s' (%d bytes) does not fit on %s (%d bytes of room): splitting it",
            name,
            self.sizes.get(name, 0),
            device,
            room,
        )
        self.pending[:0] = _parts(name, module)
        self._update_largest_layer()
        return True

    def warn_if_offloaded_buffers_fit_no_gpu(self) -> None:
        """Buffers of modules on "cpu" / "disk" live on the execution device when not offloaded: warn when no GPU has
        room left for them."""
        size = self.buffer_bytes.get("cpu", 0) + self.buffer_bytes.get("disk", 0)
        used = {device: bytes_ for device, bytes_ in self.used.items() if bytes_ > 0}
        fits = any(
            memory >= size + used.get(device, 0)
            for device, memory in self.max_memory.items()
            if device not in ("cpu", "disk")
        )
        if size and self.gpus and not fits:
            warnings.warn(
                f"Current model requires {size} bytes of buffer for offloaded layers, which seems does not "
                "fit any GPU's remaining memory. If you are experiencing a OOM later, please consider using "
                "offload_buffers=True."
            )

    def log_devices_left_empty(self) -> None:
        if not self.left_empty:
            return
        needed = "\n".join(f"  - {device}: {size} bytes required" for device, size in self.left_empty.items())
        logger.info(
            "Based on the current allocation process, no modules could be assigned to the following devices "
            "due to insufficient memory:\n%s\nThese minimum requirements are specific to this allocation "
            "attempt and may vary. Consider increasing the available memory for these devices to at least the "
            "specified minimum, or adjusting the model config.",
            needed,
        )


def _splittable(module: nn.Module | torch.Tensor, no_split: list[str]) -> bool:
    has_children = isinstance(module, nn.Module) and next(module.children(), None) is not None
    return has_children and not _no_split(module, no_split)


def _parts(name: str, module: nn.Module | torch.Tensor | None) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """The entries a module is split into: its own parameters and persistent buffers, then its children.

    HF leaves a split module's own buffers out of the map, and then cannot load a persistent one ("doesn't have any
    device set"); accel places those like parameters. Non-persistent buffers are left where the model has them
    (created with the model, not loaded), as in HF, so maps of models without such persistent buffers are HF's."""
    if not isinstance(module, nn.Module):
        return []
    own = [
        *module.named_parameters(recurse=False),
        *((n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set),
    ]
    children = [(f"{name}.{child}", sub) for child, sub in module.named_children()]
    return [(f"{name}.{n}", value) for n, value in own] + children


def get_module_size_with_ties(
    tied_params: list[str], module_size: int, module_sizes: dict[str, int], modules_to_treat: list[tuple[str, Any]]
) -> tuple[int, list[str], list[Any]]:
    """A module's size together with the modules (among `modules_to_treat`) holding the weights tied to it
    (`tied_params`), which must go where it goes: (total size, their names, the modules). Tied weights whose module
    is not among `modules_to_treat` (placed already) add nothing (HF raises IndexError)."""
    names, modules, total = [], [], module_size
    for tied in tied_params:
        owner = next(((n, m) for n, m in modules_to_treat if tied.startswith(n + ".")), None)
        if owner is None:
            continue
        names.append(owner[0])
        modules.append(owner[1])
        total += module_sizes.get(owner[0], 0) - module_sizes.get(tied, 0)
    return total, names, modules


def fallback_allocate(
    modules: list[tuple[str, Any]],
    module_sizes: dict[str, int],
    size_limit: int | str,
    no_split_module_classes: list[str] | None = None,
    tied_parameters: list[list[str]] | None = None,
) -> tuple[str | None, Any, list[tuple[str, Any]]]:
    """The first module (breadth-first, splitting modules that may be split) whose size with its tied modules fits
    `size_limit`: (its name, the module, `modules` without it, its ancestors split into their parts), or
    (None, None, `modules`) when none fits."""
    try:
        limit = convert_file_size_to_int(size_limit)
    except ValueError:
        return None, None, modules
    no_split = set(no_split_module_classes or [])
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        ties = [
            tensor
            for group in tied_parameters or []
            if any(_owns(name, t) for t in group) and not all(_owns(name, t) for t in group)
            for tensor in group
            if not _owns(name, tensor)
        ]
        if get_module_size_with_ties(ties, module_sizes.get(name, 0), module_sizes, queue)[0] <= limit:
            return name, module, _without(modules, name)
        if (
            isinstance(module, nn.Module)
            and next(module.children(), None) is not None
            and not _no_split(module, no_split)
        ):
            queue[:0] = _parts(name, module)
    return None, None, modules


def _without(modules: list[tuple[str, Any]], name: str) -> list[tuple[str, Any]]:
    """`modules` without the entry `name`, the entry holding it split (repeatedly) until it is one of them."""
    modules = list(modules)
    while True:
        names = [n for n, _ in modules]
        if name in names:
            del modules[names.index(name)]
            return modules
        index = next(i for i, n in enumerate(names) if name.startswith(n + "."))
        modules[index : index + 1] = _parts(*modules[index])


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Replaces, in place, the entries under `module_name` (and recursively under each of its children) that all
    name one device by one entry for the module ("" for the whole model); returns `device_map`. It needs no model:
    a module is merged from the entries the map has."""
    prefix = f"{module_name}." if module_name else ""
    under = [name for name in device_map if name.startswith(prefix)]
    if len(under) > 1 and len({device_map[name] for name in under}) == 1:
        device = device_map[under[0]]
        for name in under:
            del device_map[name]
        device_map[module_name] = device
    children = {
        name[len(prefix) :].split(".")[0] for name in device_map if name.startswith(prefix) and name != module_name
    }
    for child in children:
        clean_device_map(device_map, f"{prefix}{child}")
    return device_map
