"""Layerwise casting: weights stored in a small dtype (float8, bfloat16) and cast up for each layer's forward only.

Memory holds every layer in `storage_dtype`; a layer's forward runs in `compute_dtype` and it is cast back after,
so at most one layer at a time takes the larger size. Lossy (the storage dtype rounds the weights once), but no
quantization library is needed.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from accel.big_modeling.hooks import ModelHook, add_hook_to_module

logger = logging.getLogger(__name__)

# The layers whose weights are cast (their forward is a matmul or a convolution over the weight).
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


class LayerwiseCastingHook(ModelHook):
    """Casts a module to `storage_dtype` when attached and after each forward, to `compute_dtype` for the forward.

    Args:
        storage_dtype: the dtype the weights are kept in between forwards.
        compute_dtype: the dtype the forward runs in.
        non_blocking: asynchronous casts where the device allows.
    """

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Stores the weights of every linear and convolution layer of `module` in `storage_dtype` and runs each such
    layer's forward in `compute_dtype`.

    Args:
        module: the model.
        storage_dtype: e.g. `torch.float8_e4m3fn`.
        compute_dtype: e.g. `torch.bfloat16`.
        skip_modules_pattern: regular expressions (`re.search`) of module names ("norm", r"^lm_head$") to leave
            alone, with everything below them. One string is one pattern (HF iterates over its characters).
        skip_modules_classes: module classes to leave alone, with everything below them.
        non_blocking: asynchronous casts where the device allows.

    Example:
        ```python
        attach_layerwise_casting_hooks(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                       skip_modules_pattern=["norm", "lm_head"])
        ```
    """
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    _attach_casting(module, "", storage_dtype, compute_dtype, patterns, skip_modules_classes, non_blocking)


def _attach_casting(
    module: nn.Module,
    name: str,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    patterns: tuple[str, ...],
    skip_classes: tuple[type[nn.Module], ...] | None,
    non_blocking: bool,
) -> None:
    if (skip_classes is not None and isinstance(module, skip_classes)) or any(re.search(p, name) for p in patterns):
        logger.debug("layerwise casting: skipping '%s'", name)
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        add_hook_to_module(module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
        return
    for child_name, child in module.named_children():
        _attach_casting(
            child,
            f"{name}.{child_name}" if name else child_name,
            storage_dtype,
            compute_dtype,
            patterns,
            skip_classes,
            non_blocking,
        )
