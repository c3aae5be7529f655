"""The offload folder: weights kept on disk for modules dispatched to "disk", read back memory-mapped.

Format (HF Accelerate's): `index.json` maps each tensor name to {"dtype": "float32", "shape": [...]}, and each
tensor's raw bytes are in `<name>.dat`. Reading maps the file (copy-on-write) instead of reading it, so a
forward touches only the pages it needs and the page cache does the rest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping

import torch


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"offload index: unknown dtype {name!r}")
    return dtype


def offload_weight(weight: torch.Tensor, name: str, folder: str, index: dict | None = None) -> dict:
    """Writes `weight` to `folder/<name>.dat`; records it in `index` (returned)."""
    index = {} if index is None else index
    weight = weight.detach().to("cpu").contiguous()
    path = os.path.join(folder, f"{name}.dat")
    # A new file renamed over the old one: a tensor may still map the old file, and truncating a mapped file
    # kills its reader (SIGBUS).
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as f:
        if weight.numel():
            f.write(memoryview(weight.reshape(-1).view(torch.uint8).numpy()))
    os.replace(temporary, path)
    index[name] = {"dtype": str(weight.dtype).removeprefix("torch."), "shape": list(weight.shape)}
    return index


def save_offload_index(index: dict, folder: str) -> None:
    path = os.path.join(folder, "index.json")
    current = {}
    if os.path.exists(path):
        with open(path) as f:
            current = json.load(f)
    current.update(index)
    with open(path, "w") as f:
        json.dump(current, f, indent=2)


def offload_state_dict(folder: str, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Writes every tensor of `state_dict` into the offload folder `folder`; returns the index."""
    os.makedirs(folder, exist_ok=True)
    index: dict = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, folder, index)
    save_offload_index(index, folder)
    return index


def load_offloaded_weight(path: str, info: dict) -> torch.Tensor:
    """The tensor in `path`, memory-mapped (private: writes to it never reach the file)."""
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
    """name -> tensor over CPU tensors (`state_dict`) and an offload folder (`save_folder` + its index)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor] | None = None, save_folder: str | None = None,
                 index: dict | None = None):  # fmt: skip
        self.state_dict = dict(state_dict or {})
        self.save_folder = save_folder
        if index is None and save_folder is not None and os.path.exists(os.path.join(save_folder, "index.json")):
            with open(os.path.join(save_folder, "index.json")) as f:
                index = json.load(f)
        self.index = index or {}
        self.all_keys = list(self.state_dict) + [key for key in self.index if key not in self.state_dict]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        if key not in self.index:
            raise KeyError(key)
        return load_offloaded_weight(os.path.join(self.save_folder, f"{key}.dat"), self.index[key])

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
        return iter([key[len(self.prefix):] for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len([key for key in self.dataset if key.startswith(self.prefix)])
