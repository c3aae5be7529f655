"""Tied weights: one parameter known under several names (`lm_head.weight is embed.weight`).

Placement, loading and offloading must keep such a group one tensor on one device; these functions find the groups,
check a device map against them and restore them after something broke the link.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor, in groups of two or more, each in the model's own order."""
    by_identity: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def find_tied_parameters(model: nn.Module, **kwargs) -> list[list[str]]:
    """The groups of names under which one parameter is registered, each sorted.

    Example:
        >>> model = nn.Sequential(OrderedDict([("linear1", nn.Linear(4, 4)), ("linear2", nn.Linear(4, 4))]))
        >>> model.linear2.weight = model.linear1.weight
        >>> find_tied_parameters(model)
        [['linear1.weight', 'linear2.weight']]

    `kwargs` is accepted (and ignored) for HF's signature, whose recursion used it.
    """
    return [sorted(group) for group in tied_groups(model)]


def _parameter_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, attribute = name.rpartition(".")
    return (model.get_submodule(owner_name) if owner_name else model), attribute


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Makes every name of each group in `tied_params` (as `find_tied_parameters` gives) one parameter again: the
    first of the group that is not on the meta device (a group all on meta is left alone)."""
    for group in tied_params:
        owners = [_parameter_owner(model, name) for name in group]
        loaded = [getattr(owner, attribute) for owner, attribute in owners]
        keep = next((param for param in loaded if param.device.type != "meta"), None)
        if keep is None:
            continue
        for owner, attribute in owners:
            setattr(owner, attribute, keep)


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers model's config asks for tied weights (tied word embeddings with an output embedding,
    a tied encoder-decoder, or a module with `_tie_weights`); False for any other module."""
    if "PreTrainedModel" not in [cls.__name__ for cls in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    decoder = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    word_embeddings = bool(
        decoder is not None and getattr(decoder, "tie_word_embeddings", False) and model.get_output_embeddings()
    )
    encoder_decoder = bool(
        getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False)
    )
    modules = any(hasattr(module, "_tie_weights") for module in model.modules())
    return word_embeddings or encoder_decoder or modules


def _device_of(name: str, device_map: Mapping[str, int | str | torch.device]) -> int | str | torch.device:
    """The device of the longest entry of `device_map` that `name` is under."""
    probe = name
    while probe not in device_map:
        if "." not in probe:
            if "" in device_map:
                return device_map[""]
            raise ValueError(f"The `device_map` does not contain the module {name}.")
        probe = probe.rsplit(".", 1)[0]
    return device_map[probe]


def check_tied_parameters_on_same_device(
    tied_params: list[list[str]], device_map: Mapping[str, int | str | torch.device]
) -> None:
    """Logs a warning for every tied group that `device_map` spreads over several devices (a tied weight is one
    tensor: it can only live in one place). Raises ValueError for a name the map gives no device."""
    for group in tied_params:
        devices = {name: _device_of(name, device_map) for name in group}
        if len(set(devices.values())) > 1:
            logger.warning(
                "Tied parameters are on different devices: %s. Please modify your custom device map or set "
                "`device_map='auto'`.",
                devices,
            )
