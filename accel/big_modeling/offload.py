"""The offload folder: weights kept on disk for modules dispatched to "disk", read back memory-mapped.

Format (HF Accelerate's): `index.json` maps each tensor name to {"dtype": "float32", "shape": [...]}, and each
tensor's raw bytes are in `<name>.dat` (a 0-d tensor as one element, bfloat16 and float8 as their bytes, as HF's
numpy memmaps write them). An entry may instead point into a safetensors file ({"safetensors_file": path,
"weight_name": name, "dtype": ...}), as HF's `load_checkpoint_in_model` writes for weights it need not copy.
Reading maps the `.dat` file (copy-on-write) instead of reading it, so a forward touches only the pages it needs and
the page cache does the rest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from accel.big_modeling.hooks import set_module_tensor_to_device
from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.safetensors_io import read_header, read_into
from accel.unsupported import refuse
from accel.wire.byte_views import byte_view


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"offload index: unknown dtype {name!r}")
    return dtype


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict:
    """Writes `weight` to `offload_folder/<weight_name>.dat`; records it in `index` (returned; a new dict when None,
    where HF returns None)."""
    index = {} if index is None else index
    weight = weight.detach().to("cpu").contiguous()
    path = os.path.join(os.fspath(offload_folder), f"{weight_name}.dat")
    # A new file renamed over the old one: a tensor may still map the old file, and truncating a mapped file
    # kills its reader (SIGBUS). Not fsync'd: the offload folder is scratch space, rebuilt after a crash.
    data = memoryview(byte_view(weight).numpy()) if weight.numel() else b""
    write_atomically(path, lambda f: f.write(data), durable=False)
    index[weight_name] = {"dtype": str(weight.dtype).removeprefix("torch."), "shape": list(weight.shape)}
    return index


def save_offload_index(index: dict | None, offload_folder: str | os.PathLike) -> None:
    """Merges `index` into `offload_folder/index.json` (written atomically); nothing to do for an empty index."""
    if not index:
        return
    path = os.path.join(os.fspath(offload_folder), "index.json")
    current = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            current = json.load(f)
    current.update(index)
    text = json.dumps(current, indent=2)
    write_atomically(path, lambda f: f.write(text), mode="w")


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Writes every tensor of `state_dict` into the offload folder `save_dir` and its index; returns the index
    (HF returns None)."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index)
    save_offload_index(index, save_dir)
    return index


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: dict) -> torch.Tensor:
    """The tensor in `weight_file` described by its index entry `weight_info`, memory-mapped (privately: writes to
    it never reach the file). HF copies it into memory instead."""
    path, info = os.fspath(weight_file), weight_info
    dtype, shape = _dtype(info["dtype"]), tuple(info["shape"])
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    actual = os.path.getsize(path)
    if actual != expected:
        raise ValueError(f"offloaded weight '{path}' holds {actual} bytes, its index says {expected}")
    return torch.from_file(path, shared=False, size=numel, dtype=dtype).view(shape)


class OffloadedWeightsLoader(Mapping):
    """name -> tensor over CPU tensors (`state_dict`, first) and an offload folder (`save_folder` + its index,
    read from `save_folder/index.json` unless given).

    Args:
        state_dict: tensors kept in memory.
        save_folder: the offload folder.
        index: name -> entry (see the module docstring).
        device: where tensors read from a safetensors file are put (default: the CPU).
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping | None = None,
        device: torch.device | int | str | None = None,
    ):
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else os.fspath(save_folder)
        if index is None and self.save_folder is not None:
            with open(os.path.join(self.save_folder, "index.json")) as f:
                index = json.load(f)
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict) + [key for key in self.index if key not in self.state_dict]
        self.device = device
        self._headers: dict[str, Any] = {}  # safetensors file -> its validated header, read once

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            return self._from_safetensors(key, info)
        return load_offloaded_weight(os.path.join(self.save_folder, f"{key}.dat"), info)

    def _from_safetensors(self, key: str, info: Mapping) -> torch.Tensor:
        path = info["safetensors_file"]
        if path not in self._headers:
            self._headers[path] = read_header(path)
        header = self._headers[path]
        stored = header.tensors[info.get("weight_name", key)]
        dtype = _dtype(info["dtype"]) if "dtype" in info else stored.dtype
        tensor = torch.empty(stored.shape, dtype=dtype, device="cpu" if self.device is None else self.device)
        read_into(header, {stored.name: tensor})
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


class PrefixedDataset(Mapping):
    """The entries of `dataset` under `prefix`, named without it (a module's own view of the model's weights)."""

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key[len(self.prefix) :] for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len([key for key in self.dataset if key.startswith(self.prefix)])


def extract_submodules_state_dict(state_dict: Mapping[str, torch.Tensor], submodule_names: list[str]) -> dict:
    """The entries of `state_dict` that belong to the named submodules (`h.1` takes `h.1.*`, not `h.10.*`)."""
    return {
        key: value
        for name in submodule_names
        for key, value in state_dict.items()
        if key == name or key.startswith(name + ".")
    }


def load_offloaded_weights(
    model: torch.nn.Module, index: Mapping[str, dict] | None, offload_folder: str | os.PathLike
) -> None:
    """Loads every weight `index` names from `offload_folder` into `model`, on the CPU (the model no longer needs the
    folder afterwards: the weights are copies, not mappings of its files)."""
    quantized = [name for name in (index or {}) if name.endswith(".SCB")]
    if quantized:
        raise refuse(
            "bitsandbytes 8-bit weights",
            f"the offload index entry '{quantized[0]}'",
            "Offload the weights in a floating-point dtype.",
        )
    for name, info in (index or {}).items():
        weight = load_offloaded_weight(os.path.join(os.fspath(offload_folder), f"{name}.dat"), info)
        set_module_tensor_to_device(model, name, "cpu", value=weight.clone(), clear_cache=False)
