"""The Accelerator: HF Accelerate's user-facing object, as a thin facade.

It resolves the user's arguments once into a state, a strategy (how models are wrapped and synchronized)
and a precision policy, then delegates: prepared objects come from accel.data, accel.optimizer,
accel.scheduler and the strategy; collectives from accel.collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from accel import collectives, data
from accel.accelerator_config import (
    PROFILE_PATTERN_NAME,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FP8BackendType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    PrecisionType,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    gradient_accumulation_steps_from_env,
)
from accel.backends import DDP_INSTEAD, deepspeed, megatron
from accel.backends.checks import (
    parallelism_config_from_environment,
    refuse_unsupported_arguments,
    refuse_unsupported_environment,
)
from accel.backends.fp8 import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from accel.backends.parallelism import ParallelismConfig
from accel.checkpoint import save_file, training_state
from accel.checkpoint.background import SaveMode
from accel.checkpoint.model_io import save_model_files
from accel.env_vars import get_setting
from accel.optimizer import AcceleratedOptimizer, is_lomo_optimizer, lomo_optimizer_classes
from accel.precision import precision_for
from accel.precision.grads import Measured
from accel.scheduler import AcceleratedScheduler
from accel.state import AcceleratorState, DistributedType, GradientState, PartialState
from accel.strategies import SingleDeviceStrategy, StrategySettings, ddp_sync, strategy_for
from accel.strategies.base import JointPreparation, Prepared, loss_per_step
from accel.tracking.session import TrackerSession
from accel.unsupported import refuse

# Each kwargs handler class and the Accelerator attribute HF Accelerate stores it in (FP8 ones are refused).
HANDLER_ATTRIBUTES = {
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    FP8RecipeKwargs: "fp8_recipe_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
    AORecipeKwargs: "ao_recipe_handler",
    TERecipeKwargs: "te_recipe_handler",
    MSAMPRecipeKwargs: "msamp_recipe_handler",
}
PREPARED_MARK = "_is_accelerate_prepared"  # HF Accelerate's attribute name, so code that checks it keeps working
# The setups whose models DDP wraps: torch's Join applies to them (HF: multi-GPU only).
JOINABLE_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# The distributed types HF Accelerate calls multi-device (accelerators, not CPUs).
MULTI_DEVICE_TYPES = (
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_NEURON,
)
logger = logging.getLogger(__name__)


def sort_kwargs_handlers(handlers: Iterable[Any] | None) -> dict[str, Any]:
    """Handler attribute name -> handler (a subclass counts as its known base); two of one kind is an error."""
    found: dict[str, Any] = {}
    for handler in handlers or ():
        attribute = next((HANDLER_ATTRIBUTES[c] for c in type(handler).__mro__ if c in HANDLER_ATTRIBUTES), None)
        if attribute is None:
            known = ", ".join(c.__name__ for c in HANDLER_ATTRIBUTES)
            raise ValueError(f"Unsupported kwargs handler {type(handler).__name__}; accel knows {known}.")
        if attribute in found:
            raise ValueError(f"You can only pass one {type(handler).__name__} in `kwargs_handlers`.")
        found[attribute] = handler
    return found


def checked_mixed_precision(mixed_precision: Any) -> str | None:
    """`mixed_precision` as a string, validated against PrecisionType (None stays None: the state reads the env)."""
    if mixed_precision is None:
        return None
    value = str(mixed_precision.value if isinstance(mixed_precision, PrecisionType) else mixed_precision)
    if value not in PrecisionType:
        raise ValueError(f"Unknown mixed_precision mode: {value}. Choose between {PrecisionType.list()}")
    return value


def resolve_parallelism_config(config: ParallelismConfig | None, torch_tp_plugin: Any) -> ParallelismConfig | None:
    """The argument, else the deprecated `TorchTensorParallelPlugin`'s, else the environment's (as HF)."""
    if torch_tp_plugin is not None:
        warnings.warn(
            "`TorchTensorParallelPlugin` is deprecated and will be removed in a future version of "
            "Accelerate. Please use the `ParallelismConfig` with `tp_size` instead.",
            FutureWarning,
        )
    if config is not None:
        return config
    if torch_tp_plugin is not None:
        return ParallelismConfig(tp_size=torch_tp_plugin.tp_size)
    return parallelism_config_from_environment()


def accumulation_plugin(steps: int, plugin: GradientAccumulationPlugin | None) -> GradientAccumulationPlugin:
    if plugin is not None:
        if steps != 1:
            raise ValueError("Pass either `gradient_accumulation_steps` or `gradient_accumulation_plugin`, not both.")
        return plugin
    return GradientAccumulationPlugin(num_steps=gradient_accumulation_steps_from_env(steps))


class Accelerator:
    """Makes a plain PyTorch training loop run on one device, many CPU processes or many GPUs.

    Args (as HF Accelerate's):
        device_placement: move prepared models and batches to `self.device`.
        split_batches: overrides `dataloader_config.split_batches` (on a copy of the configuration).
        mixed_precision: "no", "bf16" or "fp16" (default: ACCEL_MIXED_PRECISION, else "no"). fp16 scales the
            loss with torch's GradScaler, on the CPU too (HF Accelerate refuses fp16 on the CPU).
        gradient_accumulation_steps: steps to accumulate gradients over (or ACCEL_GRADIENT_ACCUMULATION_STEPS).
        cpu: run on the CPU even when CUDA is available.
        dataloader_config: a DataLoaderConfiguration.
        rng_types: RNGs synchronized at each epoch start ("generator" by default).
        log_with: experiment trackers (see `init_trackers`).
        project_dir / project_config: where checkpoints and logs go.
        gradient_accumulation_plugin: a GradientAccumulationPlugin (instead of gradient_accumulation_steps).
        step_scheduler_with_optimizer: a prepared scheduler steps only when the optimizer did.
        kwargs_handlers: DistributedDataParallelKwargs, InitProcessGroupKwargs, AutocastKwargs, GradScalerKwargs,
            ProfileKwargs (each stored as `ddp_handler`, `init_handler`, ... as in HF).
        dynamo_backend / dynamo_plugin: torch.compile prepared models (default: ACCEL_DYNAMO_*).
        parallelism_config: a ParallelismConfig asking for data parallelism only (anything more is refused).
        fsdp_plugin: a FullyShardedDataParallelPlugin: FSDP2 (accel.strategies.fsdp2); or ACCEL_USE_FSDP.
        deepspeed_plugin / deepspeed_plugins: a DeepSpeedPlugin, or a dict of named ones (the first is active):
            DeepSpeed's engine (accel.strategies.deepspeed); or ACCEL_USE_DEEPSPEED. Not with fsdp_plugin.
        megatron_lm_plugin, torch_tp_plugin (tp_size > 1), mixed_precision "fp8" and the FP8 recipe handlers ask for
            backends accel does not run: each raises `accel.unsupported.UnsupportedFeatureError` before anything is
            set up, as do ACCEL_USE_MEGATRON_LM (or ACCELERATE_*) and ACCEL_MIXED_PRECISION=fp8.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: PrecisionType | str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: ParallelismConfig | None = None,
    ):
        # Everything accel refuses is refused here, before any state exists: nothing is ever half set up.
        refuse_unsupported_arguments(
            deepspeed_plugin,
            deepspeed_plugins,
            fsdp_plugin,
            megatron_lm_plugin,
            torch_tp_plugin,
            parallelism_config,
            mixed_precision,
            kwargs_handlers,
        )
        refuse_unsupported_environment(mixed_precision_given=mixed_precision is not None)
        mixed_precision = checked_mixed_precision(mixed_precision)
        parallelism_config = resolve_parallelism_config(parallelism_config, torch_tp_plugin)
        if dynamo_plugin is not None and dynamo_backend is not None:
            raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one.")
        handlers = sort_kwargs_handlers(kwargs_handlers)
        self._set_handlers(handlers)
        self.dataloader_config = dataclasses.replace(dataloader_config or DataLoaderConfiguration())
        if split_batches is not None:  # on a copy: the user's configuration object is left as it was
            self.dataloader_config.split_batches = split_batches
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self._tracking = TrackerSession(log_with, self.logging_dir)
        if dynamo_plugin is None:
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugin=_deepspeed_plugins(deepspeed_plugin, deepspeed_plugins),
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=torch_tp_plugin,
            parallelism_config=parallelism_config,
            _from_accelerator=True,
            **init_kwargs,
        )
        if self.parallelism_config is not None:
            self.parallelism_config._validate_accelerator(self)
        plugin = accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
        self.gradient_state = GradientState(gradient_accumulation_plugin=plugin)
        autocast, scaler = self.autocast_handler, self.scaler_handler
        self.precision = precision_for(
            self.state.mixed_precision,
            self.device,
            autocast.to_kwargs() if autocast else None,
            scaler.to_kwargs() if scaler else None,
        )
        settings = StrategySettings(
            ddp_kwargs=self.ddp_handler, fsdp_plugin=self.state.fsdp_plugin, mixed_precision=self.state.mixed_precision
        )
        self.strategy = strategy_for(self.state, self.precision, settings)
        self.precision = self.strategy.precision  # an engine that owns mixed precision (DeepSpeed) gives its own
        self.native_amp = self.precision.name in ("fp16", "bf16")  # autocast runs (CPU included)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types if rng_types is not None else ["generator"]
        self.step = 0
        self.flag_tensor: torch.Tensor | None = None
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[Any] = []
        self._custom_objects: list[Any] = []
        # OrderedDict: RemovableHandle keeps a weak reference to it (a plain dict cannot be weakly referenced).
        self._save_state_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._load_state_pre_hooks: OrderedDict[int, Any] = OrderedDict()

    def _set_handlers(self, handlers: dict[str, Any]) -> None:
        """The handler attributes HF Accelerate sets (None when not given), and its FP8 flags (always off: FP8
        handlers were refused)."""
        for attribute in HANDLER_ATTRIBUTES.values():
            setattr(self, attribute, handlers.get(attribute))
        self.has_fp8_handler = False
        self.fp8_enabled = False
        self.delayed_fp8_autocast = False
        self.has_lomo_optimizer = False

    # --- what this process is ----------------------------------------------------------------------------

    device = property(lambda self: self.state.device)
    distributed_type = property(lambda self: self.state.distributed_type)
    num_processes = property(lambda self: self.state.num_processes)
    process_index = property(lambda self: self.state.process_index)
    local_process_index = property(lambda self: self.state.local_process_index)
    is_main_process = property(lambda self: self.state.is_main_process, doc="True for one process only.")
    is_local_main_process = property(
        lambda self: self.state.is_local_main_process, doc="True for one process per machine."
    )
    is_last_process = property(lambda self: self.state.is_last_process)
    use_distributed = property(lambda self: self.state.use_distributed, doc="Whether more than one process takes part.")
    mixed_precision = property(lambda self: self.state.mixed_precision)
    scaler = property(lambda self: self.precision.scaler, doc="The fp16 gradient scaler (None otherwise).")

    @property
    def multi_device(self) -> bool:
        """Whether several processes train on accelerators (GPUs; HF's definition: not several CPU processes)."""
        return self.use_distributed and self.distributed_type in MULTI_DEVICE_TYPES

    @property
    def sync_gradients(self) -> bool:
        """Whether this step synchronizes gradients (and the prepared optimizer steps)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync_gradients: bool) -> None:
        self.gradient_state.sync_gradients = sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": steps})

    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow)."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    # --- backends and parallelism accel does not run: HF's members, with accel's (constant) answers -------------

    deepspeed_plugin = property(
        lambda self: self.state.deepspeed_plugin, doc="The active DeepSpeed plugin (None without DeepSpeed)."
    )
    deepspeed_engine_wrapped = property(
        lambda self: getattr(self.strategy, "engine_wrapper", None),
        doc="The DeepSpeed engine behind `backward` (None before prepare, or without DeepSpeed).",
    )

    @property
    def deepspeed_config(self) -> dict | None:
        """The active DeepSpeed plugin's config ("auto" values filled once a model is prepared); None without
        DeepSpeed."""
        plugin = self.state.deepspeed_plugin
        return None if plugin is None else plugin.deepspeed_config

    is_fsdp2 = property(lambda self: self.state.is_fsdp2, doc="Whether FSDP (always FSDP2 in accel) shards the models.")
    is_composable_parallelism_enabled = property(lambda self: self.is_fsdp2, doc="Whether FSDP2 runs.")
    parallelism_config = property(
        lambda self: self.state.parallelism_config, doc="The ParallelismConfig given (data parallelism only), or None."
    )
    torch_device_mesh = property(
        lambda self: self.state.device_mesh, doc="None: DDP, the only parallelism accel runs, needs no device mesh."
    )

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model weights: the local main process without a ParallelismConfig, every
        process with one (HF Accelerate's rule; each process then writes only what it holds)."""
        return self.state.is_local_main_process if self.parallelism_config is None else True

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank among the data-parallel replicas: its process index (accel runs DDP only).

        HF Accelerate raises without a ParallelismConfig; every accel setup is data parallel, so the answer is known.
        """
        return self.process_index

    data_parallel_shard_rank = property(lambda self: 0, doc="0: accel does not shard data-parallel replicas.")
    tensor_parallel_rank = property(lambda self: 0, doc="0: accel runs no tensor parallelism (one group of one).")
    pipeline_parallel_rank = property(lambda self: 0, doc="0: accel runs no pipeline parallelism (one stage).")
    context_parallel_rank = property(lambda self: 0, doc="0: accel runs no context parallelism (one group of one).")

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The FP8 engine configured by ACCEL_FP8_BACKEND / ACCELERATE_FP8_BACKEND (default NO). accel trains in
        no FP8 engine: FP8 is refused when asked for (mixed_precision="fp8" or an FP8 recipe handler)."""
        return FP8BackendType(str(get_setting("FP8_BACKEND", "NO")).upper())

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ):
        """HF's context-parallel block: without context parallelism (refused in accel, so always) it changes
        nothing, as in HF Accelerate, and says so once."""
        if not getattr(Accelerator, "_told_no_context_parallel", False):
            Accelerator._told_no_context_parallel = True
            logger.warning("Context parallel training is not enabled. This context manager will have no effect.")
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: torch.nn.Module) -> Any:
        """HF's sequence-parallel dataloader adapter: without sequence parallelism (refused), `dl` as it is."""
        return dl

    # --- running on some processes only (decided at call time, as in HF Accelerate) ---------------------------

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """This process's share of `inputs` (list, tuple, tensor, dict of them, datasets.Dataset): see
        `PartialState.split_between_processes`."""
        with PartialState().split_between_processes(inputs, apply_padding=apply_padding) as shard:
            yield shard

    def on_main_process(self, function: Callable[..., Any] | None = None):
        """Decorator: `function` runs on the main process only (everywhere without distribution).

        Works on an instance (`@accelerator.on_main_process`) and, in a class body, unbound
        (`@Accelerator.on_main_process` above a method).
        """
        return _run_only_where(self, function, "on_main_process", lambda state: state.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any] | None = None):
        """Decorator: `function` runs on each machine's local main process only."""
        return _run_only_where(self, function, "on_local_main_process", lambda state: state.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any] | None = None):
        """Decorator: `function` runs on the last process only."""
        return _run_only_where(self, function, "on_last_process", lambda state: state.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None):
        """Decorator: `function` runs on process `process_index` only (`@accelerator.on_process(process_index=1)`)."""
        if isinstance(self, Accelerator) and process_index is not None and function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _run_only_where(self, function, "on_process", lambda state: state.process_index == process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int | None = None):
        """Decorator: `function` runs on the process of local index `local_process_index` of each machine."""
        if isinstance(self, Accelerator) and local_process_index is not None and function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _run_only_where(
            self, function, "on_local_process", lambda state: state.local_process_index == local_process_index
        )

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first; the others enter it after the main process left it."""
        with self.state.main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Each machine's local main process runs the block first, then the other processes of that machine."""
        with self.state.local_main_process_first():
            yield

    def wait_for_everyone(self) -> None:
        """Blocks until every process reaches this point (bounded by the process group timeout)."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` once per machine (on the local main process)."""
        self.state.print(*args, **kwargs)

    # --- prepare -----------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepares models, optimizers, dataloaders and schedulers, in any order; returns them in that order.

        Schedulers are prepared last, so they follow the prepared optimizers.
        """
        self.strategy.check_device_placement(device_placement)
        placements = device_placement or [None] * len(args)
        if len(placements) != len(args):
            raise ValueError(f"device_placement has {len(placements)} entries for {len(args)} objects")
        together = self.strategy.prepare_together(list(args), self._joint_preparation(args))
        if together is not None:
            return self._register(together)
        first = [self._prepare_one(obj, placement, schedulers=False) for obj, placement in zip(args, placements)]
        result = tuple(self._prepare_one(obj, placement, schedulers=True) for obj, placement in zip(first, placements))
        return result if len(result) > 1 else result[0]

    def _joint_preparation(self, args: tuple) -> JointPreparation:
        loaders = [obj for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
        return JointPreparation(
            prepare_data_loader=lambda loader: self._prepare_one(loader, None, schedulers=False),
            batch_sizes=[loader.batch_size for loader in loaders],
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_processes=self.num_processes,
            split_batches=self.split_batches,
            step_scheduler_with_optimizer=self.step_scheduler_with_optimizer,
            dynamo_plugin=self.state.dynamo_plugin,
        )

    def _register(self, prepared: Prepared) -> Any:
        """Keeps what a strategy prepared together (its models, optimizers and schedulers), marked as prepared."""
        for obj in prepared.models + prepared.optimizers + prepared.schedulers:
            with contextlib.suppress(AttributeError):
                setattr(obj, PREPARED_MARK, True)
        self._models += prepared.models
        self._optimizers += prepared.optimizers
        self._schedulers += prepared.schedulers
        if prepared.gradient_accumulation_steps is not None:
            self.gradient_accumulation_steps = prepared.gradient_accumulation_steps
        return tuple(prepared.objects) if len(prepared.objects) > 1 else prepared.objects[0]

    def _prepare_one(self, obj: Any, device_placement: bool | None, schedulers: bool) -> Any:
        if getattr(obj, PREPARED_MARK, False):
            return obj  # preparing twice would shard a loader twice or wrap DDP in DDP
        prepared = self._prepare_new(obj, device_placement, schedulers)
        if prepared is not obj or isinstance(prepared, (torch.nn.Module, AcceleratedOptimizer)):
            with contextlib.suppress(AttributeError):
                setattr(prepared, PREPARED_MARK, True)
        return prepared

    def _prepare_new(self, obj: Any, device_placement: bool | None, schedulers: bool) -> Any:
        _refuse_backend_placeholder(obj)
        if schedulers:
            is_scheduler = isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and not isinstance(
                obj, AcceleratedScheduler
            )
            return self.prepare_scheduler(obj) if is_scheduler else obj
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=device_placement)
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=device_placement)
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
            return self.prepare_optimizer(obj, device_placement=device_placement)
        return obj

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Places, autocasts (bf16/fp16), wraps (DDP) and compiles (dynamo) a model."""
        placement = self.device_placement if device_placement is None else device_placement
        # The model as given, not its DDP / compile wrappers, as HF Accelerate keeps it: save_state writes its names
        # (HF loads them strictly into a model as given) and the save / load hooks get it.
        self._models.append(model)
        model = self.precision.wrap_forward(model)
        plugin = self.state.dynamo_plugin
        if evaluation_mode:
            return SingleDeviceStrategy(self.state, self.precision).setup_model(model, placement, plugin)
        return self.strategy.setup_model(model, placement, plugin)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        placement = self.device_placement if device_placement is None else device_placement
        self.has_lomo_optimizer |= is_lomo_optimizer(optimizer)
        prepared = self.strategy.setup_optimizer(optimizer, placement)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        followed = [opt for opt in self._optimizers if opt.optimizer is scheduler.optimizer] or self._optimizers
        prepared = AcceleratedScheduler(
            scheduler,
            followed,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None
    ) -> Any:
        config = self.dataloader_config
        prepared = data.prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=config.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            non_blocking=config.non_blocking,
            data_seed=config.data_seed,
            use_stateful_dataloader=config.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        return data.skip_first_batches(dataloader, num_batches=num_batches)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module inside DDP (and torch.compile, unless `keep_torch_compile`, as in HF Accelerate:
        then the compiled wrapper is returned around the unwrapped module); the bf16 forward kept or removed.
        See `accel.module_tree.extract_model_from_parallel`."""
        return self.strategy.unwrap(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    # --- the training step -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, the loss divided by the accumulation steps (as HF Accelerate).

        With a LOMO optimizer prepared (without fp16's scaler) and `learning_rate=` given, runs `lomo_backward`.
        """
        learning_rate = kwargs.get("learning_rate")
        steps = self.gradient_accumulation_steps
        if self.scaler is None and learning_rate is not None and self.has_lomo_optimizer:
            self.lomo_backward(loss_per_step(loss, steps), learning_rate)
        else:  # the strategy divides by the steps (an engine that accumulates itself, DeepSpeed, does not)
            self.strategy.backward(loss, steps, self.sync_gradients, **kwargs)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """The fused backward-and-update of the prepared LOMO optimizers (`lomo_optim`'s Lomo / AdaLomo).

        Raises:
            ImportError: `lomo_optim` is not installed.
            ValueError: no learning rate, or no LOMO optimizer was prepared.
        """
        lomo_classes = lomo_optimizer_classes()
        if lomo_classes is None:
            raise ImportError(
                "lomo_backward needs the `lomo_optim` package (pip install lomo-optim) and an "
                "optimizer from it (Lomo or AdaLomo) passed to accelerator.prepare()."
            )
        if learning_rate is None:
            raise ValueError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
        lomo = [opt.optimizer for opt in self._optimizers if isinstance(opt.optimizer, lomo_classes)]
        if not lomo:
            raise ValueError(
                "Backward pass not properly called on LOMO optimizers. Are you sure you passed a LOMO "
                "optimizer in accelerator.prepare()?"
            )
        for optimizer in lomo:
            optimizer.fused_backward(loss, learning_rate)

    def _do_sync(self) -> None:
        if self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients(self.step % self.gradient_state.num_steps == 0)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """Inside it, gradients accumulate for `gradient_accumulation_steps` batches before they are synced
        and the prepared optimizer steps (earlier at the end of the dataloader)."""
        self._do_sync()
        sync_each_batch = self.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        allow_sync = self.sync_gradients or (self.use_distributed and sync_each_batch)
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(contextlib.nullcontext() if allow_sync else self.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Gradients computed inside are not synchronized across processes."""
        return self.strategy.no_sync(model)

    @staticmethod
    def trigger_sync_in_backward(model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The backward inside synchronizes `model`'s gradients, even after forwards run under `no_sync`.

        Example:
            ```python
            with accelerator.no_sync(model):
                loss_a = loss_fn(model(input_a))
                loss_b = loss_fn(model(input_b))
            accelerator.backward(loss_a)  # accumulates locally
            with accelerator.trigger_sync_in_backward(model):
                accelerator.backward(loss_b)  # all-reduces the accumulated gradients
            ```
        Without DDP (one process) it does nothing.
        """
        return ddp_sync.trigger_sync_in_backward(model)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None):
        """Trains (or evaluates) DDP models on processes with different numbers of batches: torch's `Join`.

        Processes whose data ran out shadow the gradient all-reduces of those still training until all are done.
        `even_batches` overrides, for the block, the setting of every prepared dataloader; `False` is what makes
        the numbers of batches differ. Unlike HF Accelerate, which does this only on GPUs (and warns on several
        CPU processes), accel joins on CPU processes too. Outside distribution it does nothing.

        Example:
            ```python
            with accelerator.join_uneven_inputs([model], even_batches=False):
                for batch in loader:
                    accelerator.backward(loss_fn(model(batch)))
                    optimizer.step()
                    optimizer.zero_grad()
            ```
        """
        if self.distributed_type not in JOINABLE_TYPES:
            if self.distributed_type != DistributedType.NO:  # HF's warning, for setups whose models are not DDP's
                warnings.warn(
                    "Joining uneven inputs is only supported for multi-GPU and multi-CPU (DDP) training, as "
                    "a result `join_uneven_inputs` will have no effect."
                )
            yield joinables
            return
        restore = data.override_even_batches(self._dataloaders, even_batches) if even_batches is not None else None
        enable = not (self.even_batches if even_batches is None else even_batches)
        for loader in self._dataloaders:
            loader.joined_by_torch = enable
        try:
            with ddp_sync.join(joinables, enable=enable):
                yield joinables
        finally:
            for loader in self._dataloaders:
                loader.joined_by_torch = False
            if restore is not None:
                restore()

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Runs the enclosed code in the mixed-precision context; a handler replaces the Accelerator's own."""
        return self.precision.autocast(autocast_handler.to_kwargs() if autocast_handler else None)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divides gradients by the loss scale (fp16; once per step, as torch's GradScaler allows)."""
        self._unscale(optimizer)

    def _unscale(self, optimizer: Any = None) -> Measured:
        return self.precision.unscale(self._inner_optimizers(optimizer))

    def _inner_optimizers(self, optimizer: Any = None) -> list[torch.optim.Optimizer]:
        optimizers = (
            self._optimizers if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
        )
        return [getattr(opt, "optimizer", opt) for opt in optimizers]

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Unscales (fp16), then clips as `torch.nn.utils.clip_grad_norm_`; returns the total norm.

        With the native kernels and norm_type 2, the norm comes from the unscale's own pass over the gradients
        (or one read-only pass without fp16) and the clip is one fused scaling: see accel.precision.grads. Where
        each process holds a shard of every gradient (FSDP2), the norm is summed across the shards.
        """
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type, self._inner_optimizers())

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        self.strategy.clip_grad_value_(parameters, clip_value, self._inner_optimizers())

    # --- collectives ----------------------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gathers across processes and drops the samples that sharding duplicated at the end of the data,
        so an evaluation pass sees each sample exactly once."""
        return data.gather_for_metrics(input_data, self.gradient_state, use_gather_object=use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return collectives.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        return collectives.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Marks this process; `check_trigger` then returns True on every process (e.g. to stop early)."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        if collectives.reduce(flag, reduction="sum").item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # --- housekeeping ---------------------------------------------------------------------------------------

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Saves on the main process (each node's, with ProjectConfiguration(save_on_each_node=True));
        safetensors for a state dict with safe_serialization."""
        if not self._saves_here():
            return
        if safe_serialization:
            save_file(obj, f, metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def _saves_here(self) -> bool:
        each_node = self.project_configuration.save_on_each_node
        return self.is_local_main_process if each_node else self.is_main_process

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The model's full state dict, of the user's module (DDP and compile wrappers removed) unless
        `unwrap=False` (a sharded model's is gathered)."""
        return self.strategy.model_state_dict(model, unwrap=unwrap)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
        *,
        async_save: bool | None = None,
        durable: bool | None = None,
    ) -> None:
        """Saves the weights in Hugging Face's layout (`model.safetensors`, or shards + index), on the main process.

        Shards are split as huggingface_hub splits them; tied weights are saved once; the files are written under
        temporary names and published together (a kill leaves the old or the new checkpoint). `async_save` /
        `durable` (accel's; default: the ProjectConfiguration's fields) pick the save mode, see
        accel.checkpoint.background. See accel.checkpoint.model_io.
        """
        state_dict = self.get_state_dict(model)
        if self._saves_here():
            mode = SaveMode.resolve(self.project_configuration, async_save, durable)
            save_model_files(state_dict, save_directory, max_shard_size, safe_serialization, mode)

    # --- checkpoints: accel.checkpoint.training_state --------------------------------------------------------

    def checkpointable(self) -> training_state.Checkpointable:
        """What `save_state` / `load_state` cover (accel's; accel.checkpoint.training_state reads nothing else of
        the Accelerator): the prepared models (as given to `prepare`, without the DDP / compile wrappers, as HF
        keeps them), optimizers, schedulers and dataloaders, the objects registered for
        checkpointing and the scaler (the Accelerator's own lists), how a model's weights are taken, the project
        configuration and directory, whether this process writes the shared files, and where it runs.

        Example:
            ```python
            parts = accelerator.checkpointable()
            print(len(parts.models), len(parts.optimizers), parts.step)
            ```
        """
        return training_state.Checkpointable(
            models=self._models,
            optimizers=self._optimizers,
            schedulers=self.strategy.checkpointed_schedulers(self._schedulers),
            dataloaders=self._dataloaders,
            custom_objects=self._custom_objects,
            scaler=self.scaler,
            state_dict=functools.partial(self.get_state_dict, unwrap=False),
            project_configuration=self.project_configuration,
            project_dir=self.project_dir,
            writes_shared_files=self._saves_here(),
            process_index=self.process_index,
            num_processes=self.num_processes,
            device=self.device,
            step=self.step,
            sharded=self.strategy.sharded_states(),
        )

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool | None = None,
        durable: bool | None = None,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Saves models, optimizers, schedulers, dataloaders, scaler, RNG states and registered objects into
        `output_dir` (or the next `checkpoints/checkpoint_N` with automatic naming), atomically; returns the folder.
        `async_save` / `durable`: the save mode (accel's; see save_model)."""
        mode = SaveMode.resolve(self.project_configuration, async_save, durable)
        hooks = list(self._save_state_pre_hooks.values())
        return training_state.save_state(self.checkpointable(), output_dir, safe_serialization, hooks, mode)

    def wait_for_checkpoint(self) -> None:
        """Waits until every save of every process is written, published and durable, then removes the checkpoints
        `total_limit` kept until then; raises, on every process, a failure of one that ran in the background
        (accel's; every process calls it; see accel.checkpoint.background)."""
        training_state.join_saves(self.checkpointable())

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> str:
        """Restores what `save_state` saved (default: the latest numbered checkpoint); returns the folder.

        `load_kwargs` go to `torch.load` (weights_only=True unless they say otherwise); `strict=False` lets the
        models' weights differ in names from the checkpoint's.
        """
        strict = load_model_func_kwargs.pop("strict", True)
        hooks = list(self._load_state_pre_hooks.values())
        folder, step = training_state.load_state(self.checkpointable(), input_dir, load_kwargs, hooks, strict=strict)
        if step is not None:
            self.step = step
        return folder

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Adds objects with `state_dict` / `load_state_dict` to what save_state / load_state cover."""
        invalid = [
            f"{i}: {type(obj).__name__}"
            for i, obj in enumerate(objects)
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
        ]
        if invalid:
            raise ValueError(
                "register_for_checkpointing needs objects with state_dict and load_state_dict; "
                f"these have not: {', '.join(invalid)}"
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Any) -> RemovableHandle:
        """`hook(models, weights, output_dir)` runs in save_state before anything is written."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Any) -> RemovableHandle:
        """`hook(models, input_dir)` runs in load_state before anything is read."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    save_iteration = property(
        lambda self: self.project_configuration.iteration,
        doc="The number the next automatically named checkpoint gets.",
    )

    def free_memory(self, *objects: Any) -> tuple:
        """Drops the references this Accelerator holds (and returns `objects` as None; a DeepSpeed engine is
        destroyed), then frees caches."""
        self.strategy.release()
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    clear = free_memory

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether `model` (or a submodule) was dispatched with a device map over several devices (`hf_device_map`
        with more than one entry): such a model is placed already and must not be prepared for DDP."""
        return any(len(getattr(module, "hf_device_map", ())) > 1 for module in model.modules())

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None):
        """Profiles the block with `torch.profiler` (settings: `profile_handler`, else the Accelerator's
        ProfileKwargs, else torch's defaults); yields the profiler.

        With `output_trace_dir`, each process writes its Chrome trace there as `profile_<process index>.json`
        when the block ends, then waits for the others.

        Example:
            ```python
            with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir="trace")) as prof:
                train_step()
            accelerator.print(prof.key_averages().table(row_limit=10))
            ```
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(
            os.path.join(handler.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=self.process_index))
        )
        self.wait_for_everyone()

    def __deepcopy__(self, memo: dict) -> Accelerator:
        # One Accelerator per process (its state is shared): a deep copy of an object holding it (a Trainer's
        # arguments, say) keeps pointing at the same one, as in HF Accelerate.
        return self

    # --- experiment tracking: accel.tracking ---------------------------------------------------------------

    trackers = property(
        lambda self: self._tracking.trackers,
        doc="The trackers running on this process (those `init_trackers` started here).",
    )
    log_with = property(
        lambda self: self._tracking.log_with,
        doc="What `log_with` asked for: LoggerTypes, registered names and tracker instances.",
    )

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Starts a run in every tracker of `log_with`, on the main process (and on every process for trackers
        with `main_process_only = False`), and stores `config` as its hyperparameters (nested dicts flattened).

        Args:
            project_name: the project / run name each tracker uses (TensorBoard and jsonl: a folder under
                `logging_dir`).
            config: the hyperparameters to store.
            init_kwargs: per tracker, keyword arguments for its constructor: `{"wandb": {"tags": ["a"]}}`.
        """
        self._tracking.init(project_name, config, init_kwargs, self.logging_dir, self.is_main_process)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker named `name` (its backend object, e.g. the wandb run, with `unwrap`); on a process where it
        does not run, an inert placeholder whose every method does nothing."""
        return self._tracking.get(name, unwrap)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Logs `values` (name -> number, text, ...) at `step` to every tracker running on this process.

        Before `init_trackers` nothing is logged (one warning). Values a backend cannot take are skipped with one
        warning naming the key. `log_kwargs`: per tracker, keyword arguments for its `log`.
        """
        self._tracking.log(values, step, log_kwargs, self.is_main_process)

    def end_training(self) -> None:
        """Waits for every process's checkpoints (wait_for_checkpoint, and the rotation it completes), finishes every
        tracker (all of them, even if one fails), then destroys the process group."""
        try:
            training_state.finish(self.checkpointable())
        finally:
            try:
                self._tracking.finish()
            finally:
                self.state.destroy_process_group()


def _run_only_where(
    owner: Any, function: Callable | None, name: str, selected: Callable[[PartialState], bool]
) -> Callable:
    """`function` wrapped to run only on the processes `selected` picks (everywhere without distribution; None
    elsewhere), decided at each call. Used unbound in a class body, `owner` is the decorated method itself."""
    if function is None:
        if isinstance(owner, Accelerator) or not callable(owner):
            raise ValueError(
                f"The `{name}` decorator must be called with a function on an instantiated `Accelerator` object."
            )
        function = owner

    @functools.wraps(function)
    def run_if_selected(*args: Any, **kwargs: Any) -> Any:
        state = PartialState()
        if state.use_distributed and not selected(state):
            return None
        return function(*args, **kwargs)

    return run_if_selected


def _refuse_backend_placeholder(obj: Any) -> None:
    """DeepSpeed's and Megatron-LM's stand-ins for optimizers and schedulers only mean something to those engines
    (under DeepSpeed the strategy prepares them; they never get here)."""
    if isinstance(obj, (deepspeed.DummyOptim, deepspeed.DummyScheduler)):
        raise ValueError(
            f"accelerator.prepare({type(obj).__name__}(...)): it stands for the optimizer or scheduler "
            "of a DeepSpeed config and needs DeepSpeed (`deepspeed_plugin=`, `accel launch "
            "--use_deepspeed`); without it, build a torch optimizer / scheduler"
        )
    if isinstance(obj, megatron.MegatronLMDummyScheduler):
        raise refuse(
            "Megatron-LM",
            f"accelerator.prepare({type(obj).__name__}(...))",
            DDP_INSTEAD + " Build a torch scheduler instead.",
        )


def _deepspeed_plugins(plugin: Any, plugins: Any) -> Any:
    """The DeepSpeed plugin(s) of `Accelerator(deepspeed_plugin=..., deepspeed_plugins=...)` (aliases): those of a
    running DeepSpeed state for a second Accelerator, which may not bring its own (HF's rule)."""
    given = plugins if plugins is not None else plugin
    running = AcceleratorState._shared_state.get("distributed_type") == DistributedType.DEEPSPEED
    if given is not None and running and AcceleratorState().deepspeed_plugins is not None:
        raise NotImplementedError(
            "You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`. "
            "Please make sure the first `Accelerator` is initialized with all the plugins you "
            "want to use."
        )
    return AcceleratorState().deepspeed_plugins if given is None and running else given


__all__ = ["Accelerator"]
