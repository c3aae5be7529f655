"""Whole-model offload for pipelines (diffusers' "model CPU offload"): `cpu_offload_with_hook`.

Each model of a pipeline lives on the CPU and moves to the execution device when it runs; it stays there (a model
called in a loop is moved once) until the next model of the chain runs, which sends its predecessor back to the
CPU first. So at most one model of the chain occupies the accelerator at a time, at the cost of one transfer per
model per pipeline run, far fewer than `cpu_offload`'s per-module transfers on every forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from accel.big_modeling.device_map import check_device_same
from accel.big_modeling.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from accel.memory import clear_device_cache
from accel.pytree import send_to_device
from accel.state import PartialState


def _device_of(module: nn.Module) -> torch.device | None:
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return None if tensor is None else tensor.device


class CpuOffload(ModelHook):
    """Keeps a model on the CPU until its forward, then moves it (and its inputs) to `execution_device`, where it
    stays until `init_hook` is called again (`UserCpuOffloadHook.offload`).

    Args:
        execution_device: where the forward runs; by default `PartialState().default_device` (a GPU when there is
            one, else the CPU).
        prev_module_hook: the `UserCpuOffloadHook` of the model that runs before this one in the pipeline: it is
            offloaded to the CPU just before this model's forward.
    """

    def __init__(
        self,
        execution_device: torch.device | int | str | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ):
        if execution_device is None:
            execution_device = PartialState().default_device
        self.execution_device = execution_device
        self.prev_module_hook = prev_module_hook

    @property
    def _device(self) -> torch.device:
        device = self.execution_device
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        previous = self.prev_module_hook
        if isinstance(previous, UserCpuOffloadHook):
            previous_device = _device_of(previous.model)
            if previous_device is not None and previous_device.type != "cpu":
                previous.offload()
                clear_device_cache()  # the memory it held is what this model is about to need
        current = _device_of(module)
        if current is not None and check_device_same(current, self._device):
            return args, kwargs
        module.to(self._device)
        return send_to_device(args, self._device), send_to_device(kwargs, self._device)


class UserCpuOffloadHook:
    """A model and the `CpuOffload` hook on it, as `cpu_offload_with_hook` returns them.

    Attributes:
        model: the hooked model.
        hook: its `CpuOffload`.
    """

    def __init__(self, model: nn.Module, hook: ModelHook):
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Moves the model back to the CPU now."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Takes the hook off the model (which stays where it is)."""
        remove_hook_from_module(self.model)


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: torch.device | int | str | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Moves `model` to the CPU and hooks it to move to `execution_device` when it runs, and to stay there until
    the next model of the chain runs (or `hook.offload()` is called).

    Args:
        model: the model to offload.
        execution_device: where its forward runs (default: a GPU when there is one, else the CPU).
        prev_module_hook: the hook returned for the model that runs before this one: that model is offloaded just
            before this one's forward.

    Returns:
        (model, hook): the same model, hooked, and the `UserCpuOffloadHook` to chain the next model with.

    Example:
        ```python
        encoder, encoder_hook = cpu_offload_with_hook(encoder, "cuda")
        unet, unet_hook = cpu_offload_with_hook(unet, "cuda", prev_module_hook=encoder_hook)
        decoder, decoder_hook = cpu_offload_with_hook(decoder, "cuda", prev_module_hook=unet_hook)

        latents = encoder(prompt)        # encoder moves to the GPU
        for _ in range(50):
            latents = unet(latents)      # encoder back to the CPU once; unet moves to the GPU once
        image = decoder(latents)         # unet back to the CPU
        decoder_hook.offload()           # the last model of the chain is offloaded by hand
        ```
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)
