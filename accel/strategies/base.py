"""`Strategy`: the seam every distributed setup fills (as Lightning Fabric's strategies do).

The Accelerator asks `accel.strategies.strategy_for(state, precision, ...)` once and then only talks to the
strategy, never asking which setup it runs. A strategy owns what differs between setups:

- models: how one is placed, wrapped and compiled (`setup_model`), what the user's module inside is (`unwrap`);
- optimizers: the wrapper `prepare` returns (`setup_optimizer`), over the parameters the wrapped model trains;
- gradients: skipping synchronization while accumulating (`no_sync`), the backward (`backward`), clipping
  (`clip_grad_norm_`, `clip_grad_value_`), and where gradients live (`local_gradients`, `sum_across_shards`,
  `max_across_shards`: the whole gradient on every process, or one shard of it);
- state: the model's full state dict (`model_state_dict`);
- preparing: an engine that needs the model, optimizer and scheduler at once (DeepSpeed) prepares them together
  (`prepare_together`); the others leave each object to the Accelerator's one-by-one preparation.

What a mixed-precision policy owns (autocast, the loss scaler, the optimizer step through it) is its
`accel.precision.Precision`'s, which the strategy holds and hands the gradients it sees.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from accel.compilation import compile_regions_in_place, is_compiled_module
from accel.module_tree import extract_model_from_parallel
from accel.optimizer import AcceleratedOptimizer
from accel.precision import Precision
from accel.precision import grads as grad_ops
from accel.state import PartialState


@dataclasses.dataclass(frozen=True)
class StrategySettings:
    """What the Accelerator was given that a strategy may need (each strategy reads its own)."""

    ddp_kwargs: Any = None  # DistributedDataParallelKwargs
    fsdp_plugin: Any = None  # FullyShardedDataParallelPlugin
    mixed_precision: str = "no"


@dataclasses.dataclass(frozen=True)
class JointPreparation:
    """What a strategy that prepares objects together needs of the Accelerator."""

    prepare_data_loader: Callable[[Any], Any]  # the Accelerator's (shards, places and registers a dataloader)
    batch_sizes: list[int | None]  # of the dataloaders given, as given
    gradient_accumulation_steps: int
    num_processes: int
    split_batches: bool
    step_scheduler_with_optimizer: bool
    dynamo_plugin: Any = None


@dataclasses.dataclass
class Prepared:
    """What `prepare_together` made: `objects` in the caller's order (prepared ones replaced), what the Accelerator
    registers, and the accumulation steps the engine settled on (None: the Accelerator's stand)."""

    objects: list[Any]
    models: list[Any] = dataclasses.field(default_factory=list)
    optimizers: list[Any] = dataclasses.field(default_factory=list)
    schedulers: list[Any] = dataclasses.field(default_factory=list)
    gradient_accumulation_steps: int | None = None

    def replace(self, pairs: list[tuple[Any, Any]]) -> None:
        """Replaces each given object by its prepared one (pairs whose object is None are skipped)."""
        replacements = {id(given): prepared for given, prepared in pairs if given is not None}
        self.objects = [replacements.get(id(obj), obj) for obj in self.objects]


def compile_model(model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
    """`torch.compile(model)` with the plugin's settings; a model without a plugin, or compiled already, as is.

    With `use_regional_compilation`, each repeated block (and each module without repeated blocks) is compiled in
    place instead (`nn.Module.compile`, HF's recipe for FSDP2 and DeepSpeed, used here for every strategy): a
    block is compiled once and reused for its repeats, the model keeps its module tree and names, and the hooks
    of a wrapper around it (DDP, `fully_shard`) still run.
    """
    if dynamo_plugin is None or not dynamo_plugin.enabled or is_compiled_module(model):
        return model
    if dynamo_plugin.use_regional_compilation:
        return compile_regions_in_place(model, **dynamo_plugin.compile_kwargs())
    return torch.compile(model, **dynamo_plugin.compile_kwargs())


def loss_per_step(loss: torch.Tensor, accumulation_steps: int) -> torch.Tensor:
    """`loss` divided by the accumulation steps: the accumulated gradient is then the mean over the steps, as HF
    Accelerate makes it."""
    # Dividing by 1 changes no value but costs an op and a node in the graph at every step.
    return loss if accumulation_steps == 1 else loss / accumulation_steps


class Strategy(abc.ABC):
    """How models train in one distributed setup.

    Args:
        state: The process state (its device is where models go).
        precision: The mixed-precision policy (autocast, loss scaling, the optimizer step).
    """

    def __init__(self, state: PartialState, precision: Precision):
        self.state = state
        self.precision = precision

    @classmethod
    def create(cls, state: PartialState, precision: Precision, settings: StrategySettings) -> Strategy:
        """The strategy for `state`, built from the Accelerator's settings it uses: only the state and the
        precision here; a strategy that needs more (DDP's `DistributedDataParallelKwargs`, FSDP's plugin) overrides
        this."""
        return cls(state, precision)

    @property
    def device(self) -> torch.device:
        """The device this process's models go to."""
        return self.state.device

    # --- preparing --------------------------------------------------------------------------------------------

    def check_device_placement(self, device_placement: list[bool] | None) -> None:
        """Raises if this setup cannot honour `prepare(..., device_placement=...)` (DeepSpeed places itself)."""

    def prepare_together(self, objects: list[Any], joint: JointPreparation) -> Prepared | None:
        """Prepares `objects` (a `prepare` call's arguments) together, or None: the Accelerator prepares each."""
        return None

    def checkpointed_schedulers(self, schedulers: list) -> list:
        """The prepared schedulers whose state save_state writes itself (all, unless an engine's checkpoint holds
        some)."""
        return schedulers

    def release(self) -> None:
        """Drops what this strategy holds of prepared objects (`Accelerator.free_memory`)."""

    # --- models ---------------------------------------------------------------------------------------------

    def setup_model(self, model: torch.nn.Module, device_placement: bool, dynamo_plugin: Any = None) -> torch.nn.Module:
        """Places the model, wraps it for this setup and compiles it (`dynamo_plugin`, a TorchDynamoPlugin)."""
        model = model.to(self.device) if device_placement else model
        return self.wrap(model, dynamo_plugin)

    @abc.abstractmethod
    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        """`model` (already placed) wrapped for this setup and compiled with `dynamo_plugin`."""

    def unwrap(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module inside this setup's wrappers (see `accel.module_tree.extract_model_from_parallel`)."""
        return extract_model_from_parallel(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    # --- optimizers -------------------------------------------------------------------------------------------

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool) -> AcceleratedOptimizer:
        """The wrapper `prepare` returns for `optimizer`: it steps through the precision's scaler, and only when
        gradients are synchronized."""
        return AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.precision.scaler)

    # --- gradients --------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes of `model` accumulate gradients without synchronizing them."""

    def backward(
        self, loss: torch.Tensor, accumulation_steps: int = 1, sync_gradients: bool = True, **kwargs: Any
    ) -> None:
        """Backpropagates `loss` divided by the accumulation steps (HF's rule) through the precision (which scales it
        for fp16); `sync_gradients` says whether this backward ends an accumulation (an engine that steps inside
        its backward reads it)."""
        self.precision.backward(loss_per_step(loss, accumulation_steps), **kwargs)

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float,
        optimizers: list[torch.optim.Optimizer],
    ) -> torch.Tensor:
        """Unscales `optimizers`' gradients (fp16), then clips `parameters`' as `torch.nn.utils.clip_grad_norm_`
        does; returns the total norm. The fused path measures the norm during the unscale (or in one read-only
        pass), from the gradients this process holds, summed across shards where each holds a part."""
        measured = self.precision.unscale(optimizers)
        return grad_ops.clip_grad_norm_(parameters, max_norm, norm_type, measured=measured, sharding=self)

    def clip_grad_value_(
        self, parameters: Iterable[torch.Tensor], clip_value: float, optimizers: list[torch.optim.Optimizer]
    ) -> None:
        """Unscales (fp16), then clamps every gradient to [-clip_value, clip_value]."""
        self.precision.unscale(optimizers)
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # Whether each process holds only a shard of every gradient (FSDP2); the methods below then say which part.
    shards_gradients = False

    def local_gradients(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The part of each gradient this process holds: all of it, unless a strategy shards gradients."""
        return grads

    def sharded(self, grads: list[torch.Tensor]) -> list[bool]:
        """Which of `grads` this process holds a shard of (the others it holds whole)."""
        return [False] * len(grads)

    def sum_across_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a sum over this process's gradient shards) summed over every shard: itself when every
        process holds whole gradients."""
        return tensor

    def max_across_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (e.g. an inf/nan flag of this process's shards) maxed over every shard: itself when every
        process holds whole gradients."""
        return tensor

    # --- state ------------------------------------------------------------------------------------------------

    def sharded_states(self) -> Any:
        """How save_state writes models' and optimizers' state when each process writes its shards (an
        `accel.checkpoint.sharded.ShardedStates`), or None: whole files, written by one process."""
        return None

    def model_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The model's full state dict: of the user's module (wrappers removed) unless `unwrap=False`."""
        return (self.unwrap(model) if unwrap else model).state_dict()
