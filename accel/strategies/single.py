"""One process: the model on one device, nothing to synchronize."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accel.strategies.base import Strategy, compile_model


class SingleDeviceStrategy(Strategy):
    """One process on one device: the model is only compiled (when asked), and there is nothing to synchronize."""

    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        return compile_model(model, dynamo_plugin)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
