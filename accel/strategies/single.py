"""One process: the model on one device, nothing to synchronize."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accel.compilation import is_compiled_module
from accel.state import PartialState


def compile_model(model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
    """`torch.compile(model)` with the plugin's settings; a model without a plugin, or compiled already, as is."""
    if dynamo_plugin is None or not dynamo_plugin.enabled or is_compiled_module(model):
        return model
    return torch.compile(model, **dynamo_plugin.compile_kwargs())


class SingleDeviceStrategy:
    def __init__(self, state: PartialState, ddp_kwargs=None):
        self.state = state

    @property
    def device(self) -> torch.device:
        return self.state.device

    def setup_model(self, model: torch.nn.Module, device_placement: bool, dynamo_plugin: Any = None) -> torch.nn.Module:
        """Places the model, wraps it for this setup and compiles it (`dynamo_plugin`, a TorchDynamoPlugin)."""
        model = model.to(self.device) if device_placement else model
        return self.wrap(model, dynamo_plugin)

    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        return compile_model(model, dynamo_plugin)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
