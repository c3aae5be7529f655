"""Creating models without allocating their weights: `init_empty_weights` and `init_on_device`.

Inside the context, every parameter a module registers is moved to the given device as it is registered
(the meta device for `init_empty_weights`: shapes and dtypes, no memory), so a model of any size is built in
milliseconds and then filled by a checkpoint loader. Buffers stay where the module creates them unless
`include_buffers` (or ACCEL_INIT_INCLUDE_BUFFERS / ACCELERATE_INIT_INCLUDE_BUFFERS=1) says otherwise: a buffer is
often computed at construction (rotary tables, position ids) and not stored in checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

_TRUE = ("1", "true", "yes", "on")


def _include_buffers_from_env() -> bool:
    value = os.environ.get("ACCEL_INIT_INCLUDE_BUFFERS", os.environ.get("ACCELERATE_INIT_INCLUDE_BUFFERS", ""))
    return value.strip().lower() in _TRUE


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Modules created inside put their parameters (and, with `include_buffers`, buffers) on `device`.

    Example:
        with init_on_device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)  # no weight memory allocated
    """
    device = torch.device(device)
    if include_buffers is None:
        include_buffers = _include_buffers_from_env()
    if include_buffers:
        with device:  # every tensor created inside, parameters and buffers alike
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # A parameter already there is kept as it is: `lm_head.weight = wte.weight` (weight tying) must stay one
        # parameter, not become a copy.
        if param is not None and param.device != device:
            module._parameters[name] = _moved_parameter(module._parameters[name], device)

    nn.Module.register_parameter = register_parameter_on_device
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _moved_parameter(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """`param` on `device`, of the same class and with the same attributes (e.g. transformers' flags, or what a
    quantization library's Parameter subclass takes as constructor arguments)."""
    attributes = dict(param.__dict__)
    cls = type(param)
    if cls is nn.Parameter:
        moved = nn.Parameter(param.data.to(device), requires_grad=param.requires_grad)
    else:  # a subclass (e.g. bitsandbytes' Params4bit) takes its attributes as constructor arguments
        moved = cls(param.data.to(device), **{**attributes, "requires_grad": param.requires_grad})
    for name, value in attributes.items():
        if not hasattr(moved, name):
            setattr(moved, name, value)
    return moved


def init_empty_weights(include_buffers: bool | None = None) -> contextlib.AbstractContextManager:
    """Modules created inside have their parameters on the meta device: no memory, any size, in milliseconds.

    Fill them afterwards with `load_checkpoint_and_dispatch` / `load_checkpoint_in_model`, or `to_empty()`.
    """
    return init_on_device(torch.device("meta"), include_buffers=include_buffers)
