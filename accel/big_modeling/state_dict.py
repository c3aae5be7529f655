"""State dicts of big models: one checkpoint file read straight to the devices a device map names
(`load_state_dict`), and the weights of a model whose modules are offloaded, collected module by module
(`get_state_dict_offloaded_model`, `get_state_dict_from_offload`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
from torch import nn

from accel.big_modeling.attach import align_module_device, has_offloaded_params, offload_hook
from accel.big_modeling.device_map import Device
from accel.big_modeling.dispatch import device_for
from accel.big_modeling.sizes import named_module_tensors
from accel.checkpoint.safetensors_io import read_header, read_into

logger = logging.getLogger(__name__)


def _target(device: Device) -> torch.device:
    if device == "disk":  # weights for the offload folder pass through the CPU
        return torch.device("cpu")
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def load_state_dict(
    checkpoint_file: str | os.PathLike, device_map: Mapping[str, Device] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file: a safetensors file (its header validated completely first, the tensors
    read in parallel straight into memory on their devices), or a `.bin` file (`torch.load(weights_only=True)`).

    Args:
        checkpoint_file: the file.
        device_map: {module name: device}: each tensor of a safetensors file goes to the device of the longest entry
            it is under; tensors under no entry, or under "disk", go to the CPU. A `.bin` file is loaded on the CPU.

    Raises:
        OSError / ValueError: a safetensors file saved by another framework (metadata format other than "pt").
    """
    path = os.fspath(checkpoint_file)
    if not path.endswith(".safetensors"):
        return torch.load(path, map_location="cpu", weights_only=True)
    header = read_header(path)
    _check_format(path, header.metadata)
    devices = {name: _target(device_for(device_map or {}, name) or "cpu") for name in header.tensors}
    tensors = {
        name: torch.empty(info.shape, dtype=info.dtype, device=devices[name]) for name, info in header.tensors.items()
    }
    read_into(header, tensors)
    return tensors


def _check_format(path: str, metadata: Mapping[str, str] | None) -> None:
    if not metadata:
        logger.warning(
            "The safetensors archive passed at %s does not contain metadata. Make sure to save your model "
            "with the `save_pretrained` method. Defaulting to 'pt' metadata.",
            path,
        )
        return
    if metadata.get("format", "pt") not in ("pt", "tf", "flax"):
        raise OSError(
            f"The safetensors archive passed at {path} does not contain the valid metadata "
            f"(format={metadata.get('format')!r}). Make sure you save your model with the `save_pretrained` method."
        )
    if metadata.get("format", "pt") != "pt":
        raise ValueError(f"The checkpoint passed was saved with {metadata['format']}, we need a the pt format.")


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU, with the weights of offloaded modules brought in one module at a time (so
    only one module's weights are loaded at once). Tensors still on the meta device (never loaded) are left out,
    with a warning. HF leaves out the root module's own tensors; accel does not."""
    state_dict: dict[str, torch.Tensor] = {}
    placeholders = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        whole_subtree = getattr(offload_hook(module), "place_submodules", False)  # a preloaded module
        try:
            with align_module_device(module, "cpu"):
                for name, tensor in named_module_tensors(module, recurse=whole_subtree, remove_non_persistent=True):
                    if tensor.device.type == "meta":
                        placeholders.append(prefix + name)
                    else:
                        state_dict[prefix + name] = tensor.detach().to("cpu")
        except MemoryError:
            raise MemoryError("Offloaded module must fit in CPU memory to call save_model!") from None
    missing = [name for name in placeholders if name not in state_dict]
    if missing:
        logger.warning("The following tensors were not saved because they were still on meta device: %s", missing)
    return state_dict


def get_state_dict_from_offload(
    module: nn.Module, module_name: str, state_dict: dict[str, torch.Tensor], device_to_put_offload: Device = "cpu"
) -> dict[str, torch.Tensor]:
    """Fills the entries of `state_dict` that belong to `module` (named `module_name` + ".weight"-style keys in the
    model) with its tensors, brought in on `device_to_put_offload` when it is offloaded; returns `state_dict`."""
    root = module_name[: module_name.rfind(".")]  # the module's name, without ".weight"
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, tensor in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = tensor
    return state_dict
