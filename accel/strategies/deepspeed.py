"""DeepSpeed ZeRO: the real engine (`deepspeed.initialize`) behind `Accelerator`, prepared as HF Accelerate's
`_prepare_deepspeed` prepares it.

The model, its optimizer and scheduler are prepared together (the engine needs all three): the dataloaders first,
whose batch size fills the config's "auto" micro batch size, then every "auto" value HF fills (accumulation steps,
clipping, the hidden-size based bucket sizes, `DummyOptim` / `DummyScheduler` settings), then the engine. `prepare`
returns HF's wrapper types: the engine as the model, `DeepSpeedOptimizerWrapper`, and `DeepSpeedSchedulerWrapper`
(or accel's scheduler wrapper around a torch scheduler DeepSpeed does not drive). The engine owns mixed precision
(the config's bf16 / fp16 sections), the backward, the clipping, the optimizer step and zeroing: `backward` runs the
engine's backward and, at an accumulation boundary, its step; the wrappers' `step` / `zero_grad` do nothing.

The engine runs on the job's default process group, which accel starts before DeepSpeed looks (DeepSpeed reuses an
initialized default group; one process gets a group of one): on CPU processes of one host that group moves its
tensors through accel's shared memory, and so does the clone of it ZeRO's collectives run on
(`hand_over_process_group`). What accel keeps DeepSpeed from building it does not need (each JIT build takes one to
two minutes): its own shared-memory all-reduce (used by tensor-parallel inference only, and the group already shares
memory), and on CPU processes its fused Adam (torch's Adam / AdamW run the same update: `"torch_adam": true` unless
the config sets it) and its CPU Adam for an offloaded optimizer state (`"zero_force_ds_cpu_optimizer": false`
unless set: the state is in CPU memory anyway). A build that does run prints one line first and is cached by torch
(`TORCH_EXTENSIONS_DIR`). Checkpoints: accel.checkpoint.engine_states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from accel.backends.deepspeed import (
    INSTALL,
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    map_pytorch_optim_to_deepspeed,
)
from accel.environment import patch_environment
from accel.precision import precision_for
from accel.scheduler import AcceleratedScheduler
from accel.strategies.base import JointPreparation, Prepared, Strategy
from accel.strategies.deepspeed_wrappers import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
)

logger = logging.getLogger(__name__)


def import_deepspeed(device: torch.device) -> Any:
    """The `deepspeed` module, set up for accel (see the module docstring) to run on `device`'s kind of accelerator;
    an ImportError naming the install command when it is missing."""
    # DeepSpeed picks its accelerator once, at import, by probing CUDA: CPU processes (`--cpu` on a GPU machine too)
    # name it, through the variable it reads then (unless the user set it).
    choice = {"DS_ACCELERATOR": "cpu"} if device.type == "cpu" and "DS_ACCELERATOR" not in os.environ else {}
    try:
        with patch_environment(**choice):
            import deepspeed
    except ImportError as error:
        raise ImportError(f"DeepSpeed is not installed: {INSTALL}. ({error})") from None
    _skip_unneeded_builds(deepspeed)
    _announce_builds()
    # torch 2.13 deprecates the two collectives ZeRO calls at every step, warning from each call site: the user can
    # do nothing about DeepSpeed's calls, and the warnings would bury the training's output.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
        "is deprecated",
        category=FutureWarning,
    )
    return deepspeed


def _skip_unneeded_builds(deepspeed: Any) -> None:
    # DeepSpeed's comm backend JIT-builds its shared-memory all-reduce when it starts on a CPU accelerator; only its
    # tensor-parallel inference all-reduce uses it, and accel's group moves CPU tensors through shared memory already.
    # `__compatible_ops__` is DeepSpeed's own table of the ops it may build (probed once, then kept).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _announce_builds() -> None:
    """Makes DeepSpeed print one line before it JIT-builds an op (a minute or two, silent otherwise)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "_accel_announces", False):
        return
    build = OpBuilder.jit_load

    def announced(self, verbose=True):
        if self.name not in OpBuilder._loaded_ops:
            where = os.environ.get("TORCH_EXTENSIONS_DIR", "torch's extensions cache (~/.cache/torch_extensions)")
            print(
                f"accel: DeepSpeed is building its '{self.name}' op (once, cached in {where}) ...",
                file=sys.stderr,
                flush=True,
            )
        return build(self, verbose)

    announced._accel_announces = True
    OpBuilder.jit_load = announced


def hand_over_process_group(deepspeed: Any) -> None:
    """Makes DeepSpeed run ZeRO's collectives on the job's default group, sharing memory where it does.

    DeepSpeed reuses an initialized default group, but runs ZeRO's collectives on a clone of it that it makes with
    `new_group` (its "world group"), which would be plain gloo: on CPU processes whose default group shares memory,
    accel makes that clone on its shared-memory backend.
    """
    from deepspeed.utils import groups

    from accel.backends.parallelism import mesh_backend

    default = dist.distributed_c10d._get_default_group()
    backend = mesh_backend("cpu") if default._get_backend_name() != "nccl" else None
    if groups._WORLD_GROUP is None and backend is not None:
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())), backend=backend)


def start_group_of_one(device: torch.device) -> None:
    """A default process group of this one process (DeepSpeed's engine needs one; HF's launcher starts it through
    DeepSpeed for one process too), on an in-memory store: no port, nothing outside the process."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def forget_destroyed_groups(deepspeed: Any) -> None:
    """Drops DeepSpeed's cached process groups when they belong to a destroyed default group.

    DeepSpeed keeps the groups it derives (its clone of the world group, data / model / expert parallel groups) in
    module globals, and forgets them only when the group is destroyed through `deepspeed.comm`. One destroyed
    through torch (`end_training`, a test's teardown) leaves them naming a dead group, and the next engine in this
    process fails building ("Group ... is not registered"). DeepSpeed's own release is used (0.19.8 has it).
    """
    groups = deepspeed.utils.groups
    release = getattr(groups, "_release_process_group_references", None)
    cached = [
        groups._WORLD_GROUP,
        groups._DATA_PARALLEL_GROUP,
        groups._MODEL_PARALLEL_GROUP,
        groups._TENSOR_MODEL_PARALLEL_GROUP,
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP,
        *groups._EXPERT_PARALLEL_GROUP.values(),
        *groups._EXPERT_DATA_PARALLEL_GROUP.values(),
        *groups._ALL_TO_ALL_GROUP.values(),
    ]
    if release is not None and not all(_registered(group) for group in cached if group is not None):
        release(group=None)


def _registered(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # torch's map of live groups lacks it
        return False
    return True


class DeepSpeedStrategy(Strategy):
    """The model, optimizer and scheduler run inside DeepSpeed's engine (ZeRO stage 0-3).

    Args:
        state: The process state (AcceleratorState: its active DeepSpeed plugin is read at each prepare; its device
            is where the engine runs).
        precision: No mixed precision of accel's own (`create` gives it): the engine's config holds bf16 / fp16.
    """

    def __init__(self, state, precision):
        super().__init__(state, precision)
        self.deepspeed = import_deepspeed(state.device)
        if not dist.is_initialized():
            start_group_of_one(state.device)
        forget_destroyed_groups(self.deepspeed)
        if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ:
            # DeepSpeed reads LOCAL_RANK (its engine asserts it, ZeRO-3 at every forward), which a script run alone
            # has not: set as a launcher sets it.
            os.environ["LOCAL_RANK"] = str(state.local_process_index)
        self.engine_wrapper: DeepSpeedEngineWrapper | None = None

    @classmethod
    def create(cls, state, precision, settings) -> DeepSpeedStrategy:
        # The engine owns mixed precision (the config's bf16 / fp16 sections): no autocast, no scaler, as HF.
        return cls(state, precision_for("no", state.device))

    @property
    def plugin(self) -> DeepSpeedPlugin:
        """The active plugin (`AcceleratorState().select_deepspeed_plugin` switches it between prepares)."""
        return self.state.deepspeed_plugin

    # --- prepare ----------------------------------------------------------------------------------------------

    def check_device_placement(self, device_placement: list[bool] | None) -> None:
        if device_placement is not None:
            raise ValueError("You can't customize device placements with DeepSpeed or Megatron-LM.")

    def prepare_together(self, objects: list[Any], joint: JointPreparation) -> Prepared:
        """Dataloaders through the Accelerator, then the model, optimizer and scheduler into one engine."""
        if sum(isinstance(obj, torch.nn.Module) for obj in objects) > 1:
            raise AssertionError(
                "You can't use same `Accelerator()` instance with multiple models when using DeepSpeed"
            )
        result = [
            joint.prepare_data_loader(obj) if isinstance(obj, torch.utils.data.DataLoader) else obj for obj in objects
        ]
        prepared = Prepared(result)
        config = EngineConfig(self.plugin, joint)
        prepared.gradient_accumulation_steps = config.accumulation_steps()
        model, optimizer, scheduler = _engine_parts(result, self.deepspeed)
        config.check_parts(optimizer, scheduler)
        if model is None:
            return prepared  # HF prepares the engine only with its model: the rest stays as given
        self.plugin.set_moe_leaf_modules(model)  # before the engine partitions it under ZeRO-3
        config.fill(model, optimizer, scheduler, self.state.device)
        engine, ds_optimizer, ds_scheduler = self._initialize(model, optimizer, scheduler, config.values)
        wrapped_optimizer = DeepSpeedOptimizerWrapper(ds_optimizer) if ds_optimizer is not None else None
        wrapped_scheduler = None
        if scheduler is not None:
            wrapped_scheduler = (
                DeepSpeedSchedulerWrapper(ds_scheduler, wrapped_optimizer)
                if ds_scheduler is not None
                else AcceleratedScheduler(
                    scheduler,
                    wrapped_optimizer,
                    step_with_optimizer=joint.step_scheduler_with_optimizer,
                    split_batches=joint.split_batches,
                )
            )
        prepared.replace([(model, engine), (optimizer, wrapped_optimizer), (scheduler, wrapped_scheduler)])
        prepared.models.append(engine)
        prepared.optimizers += [wrapped_optimizer] if wrapped_optimizer is not None else []
        prepared.schedulers += [wrapped_scheduler] if wrapped_scheduler is not None else []
        self._compile(engine, joint.dynamo_plugin)
        if self.engine_wrapper is None:
            self.engine_wrapper = DeepSpeedEngineWrapper(engine)
        else:
            logger.warning(
                "A wrapped DeepSpeed engine reference is currently tied for this `Accelerator()` instance. "
                "If you want to call `accelerator.backward()` referencing a new model/engine, please create "
                "a separate `Accelerator()` instance and call `accelerator.prepare()` on it."
            )
        return prepared

    def _initialize(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, config: dict) -> tuple:
        kwargs: dict[str, Any] = {"model": model, "config_params": config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = _offload_optimizer(optimizer, config, self.state.device)
            if scheduler is not None and _is_deepspeed_scheduler(scheduler, self.deepspeed):
                kwargs["lr_scheduler"] = scheduler
        hand_over_process_group(self.deepspeed)
        engine, ds_optimizer, _, ds_scheduler = self.deepspeed.initialize(**kwargs)
        return engine, ds_optimizer, ds_scheduler

    @staticmethod
    def _compile(engine: Any, dynamo_plugin: Any) -> None:
        if dynamo_plugin is None or not dynamo_plugin.enabled:
            return
        kwargs = dynamo_plugin.compile_kwargs()
        if dynamo_plugin.use_regional_compilation:
            from accel.compilation import compile_regions_in_place

            compile_regions_in_place(engine.module, **kwargs)
        else:
            engine.compile(backend=kwargs.pop("backend"), compile_kwargs=kwargs)

    def setup_model(self, model: torch.nn.Module, device_placement: bool, dynamo_plugin: Any = None) -> torch.nn.Module:
        raise RuntimeError(
            "Under DeepSpeed, models are prepared through accelerator.prepare(model, optimizer, ...): "
            "the engine is built from them together"
        )

    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        return self.setup_model(model, True, dynamo_plugin)

    def checkpointed_schedulers(self, schedulers: list) -> list:
        """Schedulers save_state writes itself: not those the engine drives (its checkpoint holds them, as HF)."""
        return [s for s in schedulers if not isinstance(s, DeepSpeedSchedulerWrapper)]

    # --- gradients --------------------------------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, accumulation_steps: int = 1, sync_gradients: bool = True, **kwargs: Any
    ) -> None:
        """The engine's backward (it scales the loss for accumulation itself), and at an accumulation boundary its
        step: clipping, the optimizer step, zeroing the gradients, the scheduler it drives."""
        if self.engine_wrapper is None:
            raise RuntimeError("accelerator.backward under DeepSpeed needs a model prepared by accelerator.prepare")
        self.engine_wrapper.backward(loss, sync_gradients=sync_gradients, **kwargs)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The engine's `no_sync` under ZeRO stage 0 and 1; stages 2 and 3 reduce gradients into their partitions at
        every backward (HF's rule)."""
        if self.plugin.zero_stage < 2 and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float,
        optimizers: list[torch.optim.Optimizer],
    ) -> Any:
        """The engine clips (the config's `gradient_clipping`) in its step; this returns the norm it measured at the
        last step (HF's behaviour), or None before any engine."""
        return None if self.engine_wrapper is None else self.engine_wrapper.get_global_grad_norm()

    def clip_grad_value_(self, parameters, clip_value, optimizers) -> None:
        raise Exception("DeepSpeed and FSDP  do not support `clip_grad_value_`. Use `clip_grad_norm_` instead.")

    # --- state ------------------------------------------------------------------------------------------------

    def sharded_states(self) -> Any:
        from accel.checkpoint.engine_states import DeepSpeedStates

        return DeepSpeedStates()

    def unwrap(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        return super().unwrap(
            getattr(model, "module", model) if _is_engine(model) else model, keep_fp32_wrapper, keep_torch_compile
        )

    def model_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """HF's rule: under ZeRO-3 the 16-bit weights gathered from every process (every process calls it; the
        main process gets them) when `stage3_gather_16bit_weights_on_model_save` allows it, else a ValueError; under
        stages 0-2 the module's own state dict, copied."""
        if _is_engine(model) and model.zero_optimization_stage() == 3:
            if not model.zero_gather_16bit_weights_on_model_save():
                raise ValueError(
                    "Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` in DeepSpeed "
                    "config is False. To save the model weights in 16bit, set "
                    "`stage3_gather_16bit_weights_on_model_save` to True in DeepSpeed config file or set "
                    "`zero3_save_16bit_model` to True when using `accel config`. To save the full checkpoint, run "
                    "`model.save_checkpoint(save_dir)` and use "
                    "`zero_to_fp32.py` (or `accel merge-weights`) to recover weights."
                )
            return model._zero3_consolidated_16bit_state_dict()
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

        return clone_tensors_for_torch_save(self.unwrap(model).state_dict())

    def release(self) -> None:
        """Destroys the engine (HF's `free_memory` under DeepSpeed)."""
        if self.engine_wrapper is not None:
            self.engine_wrapper.engine.destroy()
        self.engine_wrapper = None


def _is_engine(model: Any) -> bool:
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def _is_deepspeed_scheduler(scheduler: Any, deepspeed: Any) -> bool:
    return type(scheduler).__name__ in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES


def _engine_parts(objects: list[Any], deepspeed: Any) -> tuple[Any, Any, Any]:
    """The model, optimizer and scheduler among `objects` (the last of each kind, as HF picks them)."""
    model = optimizer = scheduler = None
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            model = obj
        elif isinstance(obj, (torch.optim.Optimizer, DummyOptim)):
            optimizer = obj
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)) or _is_deepspeed_scheduler(
            obj, deepspeed
        ):
            scheduler = obj
    return model, optimizer, scheduler


def _offload_optimizer(optimizer: torch.optim.Optimizer, config: dict, device: torch.device) -> Any:
    """The optimizer handed to the engine. With the optimizer state offloaded to the CPU, DeepSpeed insists on its
    CPU Adam (`zero_force_ds_cpu_optimizer`): on GPUs HF's mapping gives it one (a JIT build of `cpu_adam`); on CPU
    processes the state is in CPU memory anyway and the torch optimizer is kept (no build)."""
    offloaded = config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if not offloaded or not config.get("zero_force_ds_cpu_optimizer", True):
        return optimizer
    return map_pytorch_optim_to_deepspeed(optimizer)


@dataclasses.dataclass
class EngineConfig:
    """The active plugin's DeepSpeed config with every "auto" value filled as HF fills it."""

    plugin: DeepSpeedPlugin
    joint: JointPreparation

    @property
    def values(self) -> dict:
        return self.plugin.deepspeed_config

    def accumulation_steps(self) -> int:
        """The config's accumulation steps ("auto": the Accelerator's), which the Accelerator then uses (HF warns
        when they differ and takes DeepSpeed's)."""
        self.plugin.fill_match(
            "gradient_accumulation_steps",
            must_match=False,
            gradient_accumulation_steps=self.joint.gradient_accumulation_steps,
        )
        steps = self.plugin.get_value("gradient_accumulation_steps")
        if steps != self.joint.gradient_accumulation_steps:
            logger.warning(
                f"Gradient accumulation steps mismatch: GradientAccumulationPlugin has "
                f"{self.joint.gradient_accumulation_steps}, DeepSpeed config has {steps}. Using DeepSpeed's "
                "value."
            )
        return steps

    def micro_batch_size(self) -> int | None:
        if not self.plugin.is_auto("train_micro_batch_size_per_gpu"):
            return self.plugin.get_value("train_micro_batch_size_per_gpu")
        sizes = self.joint.batch_sizes
        if not sizes:
            raise ValueError(
                "When using DeepSpeed, `accelerate.prepare()` requires you to pass at least one of training or "
                "evaluation dataloaders with `batch_size` attribute returning an integer value or alternatively set "
                "an integer value in `train_micro_batch_size_per_gpu` in the deepspeed config file or assign integer "
                "value to `AcceleratorState().deepspeed_plugin.deepspeed_config['train_micro_batch_size_per_gpu']`."
            )
        if any(size is None for size in sizes):
            raise ValueError(
                "At least one of the dataloaders passed to `accelerate.prepare()` has `None` as batch size. Please set "
                "an integer value in `train_micro_batch_size_per_gpu` in the deepspeed config file or assign integer "
                "value to `AcceleratorState().deepspeed_plugin.deepspeed_config['train_micro_batch_size_per_gpu']`."
            )
        if self.joint.split_batches:
            sizes = [size // self.joint.num_processes for size in sizes]
        return min(sizes) if self.plugin.is_train_batch_min else max(sizes)

    def check_parts(self, optimizer: Any, scheduler: Any) -> None:
        """HF's rules for optimizers and schedulers given in code and in the config."""
        config = self.values
        if optimizer is not None:
            if "optimizer" in config and not isinstance(optimizer, DummyOptim):
                raise ValueError(
                    "You cannot specify an optimizer in the config file and in the code at the same time. "
                    "Please remove the optimizer from the config file or create "
                    "`accelerate.utils.DummyOptim` in the code."
                )
            if "optimizer" not in config and isinstance(optimizer, DummyOptim):
                raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config file.")
            if isinstance(optimizer, torch.optim.Optimizer):
                config["zero_allow_untested_optimizer"] = True
        if scheduler is not None:
            if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
                raise ValueError(
                    "You cannot specify a scheduler in the config file and in the code at the same time. "
                    "Please remove the scheduler from the config file or create "
                    "`accelerate.utils.DummyScheduler` in the code."
                )
            if (
                "scheduler" not in config
                and isinstance(scheduler, DummyScheduler)
                and scheduler.lr_scheduler_callable is None
            ):
                raise ValueError(
                    "Either specify a scheduler in the config file or pass in the "
                    "`lr_scheduler_callable` parameter when using `accelerate.utils.DummyScheduler`."
                )
        if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                "You can only specify `accelerate.utils.DummyScheduler` in the code when using "
                "`accelerate.utils.DummyOptim`."
            )

    def fill(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, device: torch.device) -> None:
        """Fills every "auto" value (HF's keys and rules), then accel's CPU defaults."""
        kwargs: dict[str, Any] = {
            "gradient_clipping": 1.0,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
        }
        batch_size = self.micro_batch_size()
        if batch_size is not None:
            kwargs["train_micro_batch_size_per_gpu"] = batch_size
            kwargs["train_batch_size"] = (
                batch_size * self.plugin.get_value("gradient_accumulation_steps") * self.joint.num_processes
            )
        kwargs.update(self._hidden_size_values(model))
        if isinstance(optimizer, DummyOptim):
            kwargs.update(
                {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay}
            )
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            kwargs.update(self._dummy_scheduler_values(scheduler))
        self.plugin.deepspeed_config_process(must_match=False, **kwargs)
        if device.type == "cpu":
            _cpu_defaults(self.values)

    def _hidden_size_values(self, model: torch.nn.Module) -> dict[str, Any]:
        keys = [
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold",
        ]
        auto = [key for key in keys if self.plugin.is_auto(key)]
        if not auto:
            return {}
        reasoning = (
            "therefore it's not possible to automatically fill out the following `auto` entries in the "
            f"DeepSpeed config file: {auto}. You can fix that by replacing `auto` values for these keys with "
            "an integer value of your choice."
        )
        if not hasattr(model, "config"):
            raise ValueError("Can't find `model.config` entry, " + reasoning)
        if hasattr(model.config, "hidden_size"):
            hidden = model.config.hidden_size
        elif hasattr(model.config, "hidden_sizes"):
            hidden = max(model.config.hidden_sizes)
        else:
            raise ValueError(
                "Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`, " + reasoning
            )
        return {keys[0]: hidden * hidden, keys[1]: int(0.9 * hidden * hidden), keys[2]: 10 * hidden}

    def _dummy_scheduler_values(self, scheduler: DummyScheduler) -> dict[str, Any]:
        optimizer = scheduler.optimizer
        defaults = getattr(optimizer, "defaults", None)
        max_lr = getattr(optimizer, "lr", None) if defaults is None else defaults["lr"]
        values = {
            "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": max_lr,
            # DeepSpeed 0.19.6 and later refuse 0 warm-up steps (DummyScheduler's default), as HF notes.
            "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
        }
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["scheduler.params.total_num_steps"] = (
                total if self.joint.split_batches else math.ceil(total / self.joint.num_processes)
            )
        return values


def _cpu_defaults(config: dict) -> None:
    """On CPU processes, the optimizers a config names run as torch's (DeepSpeed's fused Adam would be JIT-built for
    the same update), and an offloaded optimizer state keeps the user's torch optimizer (see `_offload_optimizer`);
    a config that sets either says otherwise and wins."""
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)


__all__ = ["DeepSpeedStrategy", "EngineConfig", "import_deepspeed"]
