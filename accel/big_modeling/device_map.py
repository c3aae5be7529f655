"""Where each part of a model goes: `get_max_memory`, `get_balanced_memory`, `infer_auto_device_map`.

A device map is {module or tensor name: device}, devices being GPU indices, "cpu" or "disk", filled in that
order: GPUs first, then CPU RAM, then the disk. `infer_auto_device_map` walks the model's modules in order and
puts each on the current device while it fits; a module that does not fit is split into its children, unless it
is a leaf or its class is in `no_split_module_classes` (a transformer block, whose residual connections must
run on one device), in which case the next device is tried. While later devices hold offloaded weights, each
GPU keeps room for the largest unsplittable module, which is brought there for its forward. A module whose
parameter is tied to one placed already goes where that parameter is (tied weights are one tensor).
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from accel.big_modeling.sizes import compute_module_sizes, tensor_bytes
from accel.big_modeling.tied import tied_groups
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


def _no_split(module: nn.Module, no_split_module_classes: set[str]) -> bool:
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
    """{module or tensor name: device} placing `model` on the devices of `max_memory` in order (module docstring).

    Args:
        offload_buffers: the buffers of modules placed on "cpu" / "disk" will be offloaded with them; without it they
            will live on the execution device, and a warning says when no GPU has room for them.
        fallback_allocation: a device on which the next module does not fit (and cannot be split) gets the first
            smaller module found breadth-first among the rest (`fallback_allocate`) instead of staying empty.

    Raises ValueError, saying how many bytes are missing, when even the last device cannot take what is left.
    """
    max_memory = get_max_memory(max_memory)
    devices = list(max_memory)
    no_split = set(no_split_module_classes or [])
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    offloading = any(d in ("cpu", "disk") for d in devices) and any(not isinstance(d, str) or d == "mps" for d in devices)
    largest_unit = max(((sizes.get(n, 0), n) for n, _ in _units(model, no_split)), default=(0, ""))
    tied = tied_groups(model)

    placed: OrderedDict[str, Device] = OrderedDict()
    pending = [(name, module) for name, module in model.named_children()]
    pending += [(name, None) for name, _ in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]]
    device_index = 0
    used = dict.fromkeys(devices, 0)

    def room(index: int) -> float:
        device = devices[index]
        if device == "disk":
            return float("inf")
        # Offloaded modules run on the main device (the first one): it keeps room for the largest of them.
        reserve = largest_unit[0] if offloading and index == 0 and device not in ("cpu", "disk") else 0
        return max_memory[device] - reserve - used[device]

    while pending:
        name, module = pending[0]
        size = sizes.get(name, 0)
        forced = _tied_device(name, tied, placed)
        splittable = module is not None and any(True for _ in module.children()) and not _no_split(module, no_split)
        if forced is not None:
            # Its tied weight is already there (counted once, under its first name). The rest of it goes there
            # too if it fits; else it is split so that only the part holding the weight must follow it.
            if size <= room(devices.index(forced)) or not splittable:
                if size > room(devices.index(forced)):
                    logger.warning("'%s' follows its tied weight to %s, beyond that device's max_memory", name, forced)
                placed[name] = forced
                used[forced] += size
                pending.pop(0)
                continue
        if device_index >= len(devices):
            needed = sum(sizes.get(n, 0) for n, _ in pending)
            raise ValueError(
                f"max_memory is too small: {needed} more bytes are needed for {', '.join(n for n, _ in pending[:5])}"
                f"{'...' if len(pending) > 5 else ''} (the model takes {sizes['']} bytes; the largest part that cannot "
                f"be split, '{largest_unit[1]}', takes {largest_unit[0]})"
            )
        device = devices[device_index]
        if forced is None and size <= room(device_index):
            placed[name] = device
            used[device] += size
            pending.pop(0)
            if verbose:
                logger.info("'%s' (%d bytes) -> %s", name, size, device)
            continue
        if splittable:
            pending.pop(0)
            pending[:0] = _parts(name, module)
            if verbose:
                logger.info("'%s' (%d bytes) does not fit on %s: splitting it", name, size, device)
            continue
        if fallback_allocation and used[device] == 0 and device != "disk":
            found, _, rest = fallback_allocate(pending, sizes, max(0, int(room(device_index))), list(no_split), tied)
            if found is not None:  # placed here now; the module that did not fit goes on to the next device
                placed[found] = device
                used[device] += sizes.get(found, 0)
                pending = rest
                continue
        if verbose:
            logger.info("'%s' (%d bytes) does not fit on %s (%d bytes used): next device", name, size, device,
                        used[device])  # fmt: skip
        device_index += 1
    if not offload_buffers:
        _warn_if_offloaded_buffers_fit_no_gpu(model, placed, max_memory, used, dtype)
    return _merged(placed, model) if clean_result else placed


def _warn_if_offloaded_buffers_fit_no_gpu(model: nn.Module, placed: dict[str, Device], max_memory: dict[Device, int],
                                          used: dict[Device, int], dtype: str | torch.dtype | None) -> None:  # fmt: skip
    """Buffers of modules on "cpu" / "disk" live on the execution device when not offloaded: warn when no GPU has
    room left for them."""
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    offloaded = [name for name, device in placed.items() if device in ("cpu", "disk")]
    size = sum(tensor_bytes(buffer, dtype) for name, buffer in model.named_buffers()
               if any(_owns(entry, name) for entry in offloaded))  # fmt: skip
    gpus = [device for device in max_memory if device not in ("cpu", "disk")]
    if size and gpus and not any(max_memory[gpu] >= size + used.get(gpu, 0) for gpu in gpus):
        warnings.warn(f"Current model requires {size} bytes of buffer for offloaded layers, which seems does not fit any "
                      "GPU's remaining memory. If you are experiencing a OOM later, please consider using "
                      "offload_buffers=True.")  # fmt: skip


def _parts(name: str, module: nn.Module | torch.Tensor | None) -> list[tuple[str, nn.Module | None]]:
    """The entries a module is split into: its own tensors (as None), then its children."""
    if not isinstance(module, nn.Module):
        return []
    own = [(f"{name}.{n}", None) for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
    return own + [(f"{name}.{child}", sub) for child, sub in module.named_children()]


def get_module_size_with_ties(tied_params: list[str], module_size: int, module_sizes: dict[str, int],
                              modules_to_treat: list[tuple[str, Any]]) -> tuple[int, list[str], list[Any]]:  # fmt: skip
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
        total += module_sizes[owner[0]] - module_sizes[tied]
    return total, names, modules


def fallback_allocate(modules: list[tuple[str, Any]], module_sizes: dict[str, int], size_limit: int | str,
                      no_split_module_classes: list[str] | None = None, tied_parameters: list[list[str]] | None = None
                      ) -> tuple[str | None, Any, list[tuple[str, Any]]]:  # fmt: skip
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
        ties = [tensor for group in tied_parameters or [] if any(_owns(name, t) for t in group)
                and not all(_owns(name, t) for t in group) for tensor in group if not _owns(name, tensor)]  # fmt: skip
        if get_module_size_with_ties(ties, module_sizes.get(name, 0), module_sizes, queue)[0] <= limit:
            return name, module, _without(modules, name)
        if isinstance(module, nn.Module) and next(module.children(), None) is not None and not _no_split(module, no_split):
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
        modules[index:index + 1] = _parts(*modules[index])


def _tied_device(name: str, tied: list[list[str]], placed: dict[str, Device]) -> Device | None:
    for group in tied:
        if any(_owns(name, tensor) for tensor in group):
            for tensor in group:
                if _owns(name, tensor):
                    continue
                for placed_name, device in placed.items():
                    if _owns(placed_name, tensor):
                        return device
    return None


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Replaces, in place, the entries under `module_name` (and recursively under each of its children) that all
    name one device by one entry for the module; returns `device_map`. Unlike `infer_auto_device_map`'s own
    cleaning it needs no model, so a module is merged only from the entries the map has."""
    prefix = f"{module_name}." if module_name else ""
    under = [name for name in device_map if name.startswith(prefix)]
    if len(under) > 1 and len({device_map[name] for name in under}) == 1:
        device = device_map[under[0]]
        for name in under:
            del device_map[name]
        device_map[module_name] = device
    children = {name[len(prefix):].split(".")[0] for name in device_map if name.startswith(prefix) and name != module_name}
    for child in children:
        clean_device_map(device_map, f"{prefix}{child}")
    return device_map


def _merged(device_map: OrderedDict[str, Device], model: nn.Module) -> OrderedDict[str, Device]:
    """Replaces every module all of whose entries share one device by a single entry for it."""
    changed = True
    while changed:
        changed = False
        parents = OrderedDict()
        for name in device_map:
            if "." in name:
                parents.setdefault(name.rsplit(".", 1)[0], []).append(name)
        for parent, names in parents.items():
            module = model.get_submodule(parent)
            expected = {f"{parent}.{n}" for n, _ in module.named_children()}
            expected |= {f"{parent}.{n}" for n, _ in [*module.named_parameters(recurse=False),
                                                       *module.named_buffers(recurse=False)]}  # fmt: skip
            if set(names) == expected and len({device_map[n] for n in names}) == 1:
                device = device_map[names[0]]
                rebuilt = OrderedDict()
                for key, value in device_map.items():
                    if key in expected:
                        if key == names[0]:
                            rebuilt[parent] = device
                    else:
                        rebuilt[key] = value
                device_map, changed = rebuilt, True
                break
    return device_map
