"""One process: the model on one device, nothing to synchronize."""

from __future__ import annotations

import contextlib

import torch

from accel.state import PartialState


class SingleDeviceStrategy:
    def __init__(self, state: PartialState, ddp_kwargs=None):
        self.state = state

    @property
    def device(self) -> torch.device:
        return self.state.device

    def setup_model(self, model: torch.nn.Module, device_placement: bool) -> torch.nn.Module:
        return model.to(self.device) if device_placement else model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside torch.compile's and DDP's wrappers."""
        while True:
            if hasattr(model, "_orig_mod"):  # torch.compile
                model = model._orig_mod
            elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
                model = model.module
            else:
                return model
