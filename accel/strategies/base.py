"""`Strategy`: the seam every distributed setup fills (as Lightning Fabric's strategies do).

The Accelerator asks `accel.strategies.strategy_for(state)` once and then only talks to the strategy: how a model
is placed, wrapped and compiled (`setup_model`), and how gradient synchronization is skipped while accumulating
(`no_sync`). It never asks which setup it runs.
"""

from __future__ import annotations

import abc
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


class Strategy(abc.ABC):
    """How a model runs in one distributed setup.

    Args:
        state: The process state (its device is where models go).
    """

    def __init__(self, state: PartialState):
        self.state = state

    @classmethod
    def create(cls, state: PartialState, ddp_kwargs: Any = None) -> Strategy:
        """The strategy for `state`, built from the Accelerator's settings it uses: only the state here; a strategy
        that needs more (DDP's `DistributedDataParallelKwargs`) overrides this."""
        return cls(state)

    @property
    def device(self) -> torch.device:
        """The device this process's models go to."""
        return self.state.device

    def setup_model(self, model: torch.nn.Module, device_placement: bool, dynamo_plugin: Any = None) -> torch.nn.Module:
        """Places the model, wraps it for this setup and compiles it (`dynamo_plugin`, a TorchDynamoPlugin)."""
        model = model.to(self.device) if device_placement else model
        return self.wrap(model, dynamo_plugin)

    @abc.abstractmethod
    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        """`model` (already placed) wrapped for this setup and compiled with `dynamo_plugin`."""

    @abc.abstractmethod
    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes of `model` accumulate gradients without synchronizing them."""
