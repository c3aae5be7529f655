"""The Accelerator: HF Accelerate's user-facing object, as a thin facade.

It resolves the user's arguments once into a state, a strategy (how models are wrapped and synchronized)
and a precision policy, then delegates: prepared objects come from accel.data, accel.optimizer,
accel.scheduler and the strategy; collectives from accel.collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from accel import collectives
from accel.checkpoint import save_file, save_state_dict
from accel.checkpoint import state as checkpoint_state
from accel.optimizer import AcceleratedOptimizer
from accel.precision import precision_for, restore_forward
from accel.precision.grads import Measured
from accel.precision.grads import clip_grad_norm_ as fused_clip_grad_norm_
from accel.scheduler import AcceleratedScheduler
from accel.settings import (
    AutocastKwargs,
    GradScalerKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    gradient_accumulation_steps_from_env,
)
from accel.state import AcceleratorState, GradientState
from accel.strategies import SingleDeviceStrategy, compiled_wrapper, strategy_for

HANDLER_TYPES = (DistributedDataParallelKwargs, InitProcessGroupKwargs, AutocastKwargs, GradScalerKwargs)
PREPARED_MARK = "_is_accelerate_prepared"  # HF Accelerate's attribute name, so code that checks it keeps working


def sort_kwargs_handlers(handlers: Iterable[Any] | None) -> dict[type, Any]:
    """One handler per type, keyed by type; two of one type is an error, as in HF."""
    found: dict[type, Any] = {}
    for handler in handlers or ():
        kind = next((t for t in HANDLER_TYPES if isinstance(handler, t)), None)
        if kind is None:
            raise ValueError(f"Unsupported kwargs handler {type(handler).__name__}; accel knows {[t.__name__ for t in HANDLER_TYPES]}")
        if kind in found:
            raise ValueError(f"You can only pass one {kind.__name__} in `kwargs_handlers`.")
        found[kind] = handler
    return found


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
        mixed_precision: "no", "bf16" or "fp16" (default: ACCEL_MIXED_PRECISION, else "no"). fp16 scales the
            loss with torch's GradScaler, on the CPU too.
        gradient_accumulation_steps: steps to accumulate gradients over (or ACCEL_GRADIENT_ACCUMULATION_STEPS).
        cpu: run on the CPU even when CUDA is available.
        dataloader_config: a DataLoaderConfiguration.
        rng_types: RNGs synchronized at each epoch start ("generator" by default).
        project_dir / project_config: where checkpoints and logs go.
        gradient_accumulation_plugin: a GradientAccumulationPlugin (instead of gradient_accumulation_steps).
        step_scheduler_with_optimizer: a prepared scheduler steps only when the optimizer did.
        kwargs_handlers: DistributedDataParallelKwargs, InitProcessGroupKwargs, AutocastKwargs, GradScalerKwargs.
        dynamo_backend / dynamo_plugin: torch.compile prepared models (default: ACCEL_DYNAMO_*).
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ):
        if deepspeed_plugin is not None or fsdp_plugin is not None:
            raise NotImplementedError("DeepSpeed and FSDP are not supported by accel yet")
        if log_with is not None:
            raise NotImplementedError("experiment trackers (log_with) are not supported by accel yet")
        handlers = sort_kwargs_handlers(kwargs_handlers)
        init_kwargs = handlers[InitProcessGroupKwargs].to_kwargs() if InitProcessGroupKwargs in handlers else {}
        self.dataloader_config = dataclasses.replace(dataloader_config or DataLoaderConfiguration())
        if split_batches is not None:  # on a copy: the user's configuration object is left as it was
            self.dataloader_config.split_batches = split_batches
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        if dynamo_plugin is None:
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
        self.state = AcceleratorState(
            mixed_precision=mixed_precision, cpu=cpu, dynamo_plugin=dynamo_plugin, _from_accelerator=True, **init_kwargs
        )
        plugin = accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
        self.gradient_state = GradientState(gradient_accumulation_plugin=plugin)
        self.strategy = strategy_for(self.state, handlers.get(DistributedDataParallelKwargs))
        autocast, scaler = handlers.get(AutocastKwargs), handlers.get(GradScalerKwargs)
        self.precision = precision_for(self.state.mixed_precision, self.device, autocast.to_kwargs() if autocast else None,
                                       scaler.to_kwargs() if scaler else None)  # fmt: skip
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

    # --- what this process is ----------------------------------------------------------------------------

    device = property(lambda self: self.state.device)
    distributed_type = property(lambda self: self.state.distributed_type)
    num_processes = property(lambda self: self.state.num_processes)
    process_index = property(lambda self: self.state.process_index)
    local_process_index = property(lambda self: self.state.local_process_index)
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    is_last_process = property(lambda self: self.state.is_last_process)
    use_distributed = property(lambda self: self.state.use_distributed)
    mixed_precision = property(lambda self: self.state.mixed_precision)
    scaler = property(lambda self: self.precision.scaler, doc="The fp16 gradient scaler (None otherwise).")
    sync_gradients = property(lambda self: self.gradient_state.sync_gradients)
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": steps})

    split_batches = property(lambda self: self.dataloader_config.split_batches)
    even_batches = property(lambda self: self.dataloader_config.even_batches)
    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow)."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    def __getattr__(self, name: str) -> Any:
        # wait_for_everyone, print, main_process_first, on_main_process, split_between_processes, ... live on
        # the state, exactly as in HF Accelerate; forwarding keeps this class a facade.
        if name in FORWARDED_TO_STATE:
            return getattr(self.__dict__["state"], name)
        raise AttributeError(f"'Accelerator' object has no attribute {name!r}")

    # --- prepare -----------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepares models, optimizers, dataloaders and schedulers, in any order; returns them in that order.

        Schedulers are prepared last, so they follow the prepared optimizers.
        """
        placements = device_placement or [None] * len(args)
        if len(placements) != len(args):
            raise ValueError(f"device_placement has {len(placements)} entries for {len(args)} objects")
        first = [self._prepare_one(obj, placement, schedulers=False) for obj, placement in zip(args, placements)]
        result = tuple(self._prepare_one(obj, placement, schedulers=True) for obj, placement in zip(first, placements))
        return result if len(result) > 1 else result[0]

    def _prepare_one(self, obj: Any, device_placement: bool | None, schedulers: bool) -> Any:
        if getattr(obj, PREPARED_MARK, False):
            return obj  # preparing twice would shard a loader twice or wrap DDP in DDP
        prepared = self._prepare_new(obj, device_placement, schedulers)
        if prepared is not obj or isinstance(prepared, (torch.nn.Module, AcceleratedOptimizer)):
            with contextlib.suppress(AttributeError):
                setattr(prepared, PREPARED_MARK, True)
        return prepared

    def _prepare_new(self, obj: Any, device_placement: bool | None, schedulers: bool) -> Any:
        if schedulers:
            is_scheduler = isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and not isinstance(obj, AcceleratedScheduler)
            return self.prepare_scheduler(obj) if is_scheduler else obj
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=device_placement)
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=device_placement)
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
            return self.prepare_optimizer(obj, device_placement=device_placement)
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> torch.nn.Module:
        """Places, autocasts (bf16/fp16), wraps (DDP) and compiles (dynamo) a model."""
        placement = self.device_placement if device_placement is None else device_placement
        self._models.append(model)
        model = self.precision.wrap_forward(model)
        plugin = self.state.dynamo_plugin
        if plugin is not None and plugin.enabled and plugin.use_regional_compilation:
            warnings.warn("accel does not support regional compilation yet; compiling the whole model")
        if evaluation_mode:
            model = SingleDeviceStrategy(self.state).setup_model(model, placement, plugin)
        else:
            model = self.strategy.setup_model(model, placement, plugin)
        self._models[-1] = model
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer:
        placement = self.device_placement if device_placement is None else device_placement
        prepared = AcceleratedOptimizer(optimizer, device_placement=placement, scaler=self.precision.scaler)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        followed = [opt for opt in self._optimizers if opt.optimizer is scheduler.optimizer] or self._optimizers
        prepared = AcceleratedScheduler(
            scheduler, followed, step_with_optimizer=self.step_scheduler_with_optimizer, split_batches=self.split_batches
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None) -> Any:
        from accel.data import prepare_data_loader

        config = self.dataloader_config
        prepared = prepare_data_loader(
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
        )
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        from accel.data import skip_first_batches

        return skip_first_batches(dataloader, num_batches=num_batches)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module inside DDP (and torch.compile, unless `keep_torch_compile`, as in HF Accelerate:
        then the compiled wrapper is returned around the unwrapped module); the bf16 forward kept or removed."""
        compiled = compiled_wrapper(model)
        inner = self.strategy.unwrap(model)
        if not keep_fp32_wrapper:
            restore_forward(inner)
        if keep_torch_compile and compiled is not None:
            compiled._orig_mod = inner
            return compiled
        return inner

    # --- the training step -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, the loss divided by the accumulation steps (as HF Accelerate)."""
        self.precision.backward(loss / self.gradient_accumulation_steps, **kwargs)

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

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Runs the enclosed code in the mixed-precision context; a handler replaces the Accelerator's own."""
        return self.precision.autocast(autocast_handler.to_kwargs() if autocast_handler else None)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divides gradients by the loss scale (fp16; once per step, as torch's GradScaler allows)."""
        self._unscale(optimizer)

    def _unscale(self, optimizer: Any = None) -> Measured:
        optimizers = self._optimizers if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
        return self.precision.unscale([getattr(opt, "optimizer", opt) for opt in optimizers])

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Unscales (fp16), then clips as `torch.nn.utils.clip_grad_norm_`; returns the total norm.

        With the native kernels and norm_type 2, the norm comes from the unscale's own pass over the gradients
        (or one read-only pass without fp16) and the clip is one fused scaling: see accel.precision.grads.
        """
        return fused_clip_grad_norm_(parameters, max_norm, norm_type, measured=self._unscale())

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # --- collectives ----------------------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gathers across processes and drops the samples that sharding duplicated at the end of the data,
        so an evaluation pass sees each sample exactly once."""
        from accel.data import gather_for_metrics_truncation

        as_objects = use_gather_object or not _all_tensors(input_data)
        if as_objects:
            gathered = collectives.gather_object(input_data)
        else:  # last batches can differ in length across ranks (even_batches=False, dispatched batches)
            gathered = collectives.gather_ragged(input_data)
        return gather_for_metrics_truncation(gathered, self.gradient_state, use_gather_object=as_objects)

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
        """The model's state dict, of the user's module (DDP and compile wrappers removed) unless `unwrap=False`."""
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    def save_model(self, model: torch.nn.Module, save_directory: str, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:  # fmt: skip
        """Saves the weights in Hugging Face's layout (`model.safetensors`, or shards + index), on the main process.

        Shards are split as huggingface_hub splits them; tied weights are saved once; every file is written
        under a temporary name and renamed, the index last. See accel.checkpoint.model_io.
        """
        state_dict = self.get_state_dict(model)
        if self._saves_here():
            save_state_dict(state_dict, save_directory, max_shard_size=max_shard_size,
                            safe_serialization=safe_serialization)  # fmt: skip

    # --- checkpoints: accel.checkpoint.state ------------------------------------------------------------------

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
                   ) -> str:  # fmt: skip
        """Saves models, optimizers, schedulers, dataloaders, scaler, RNG states and registered objects into
        `output_dir` (or the next `checkpoints/checkpoint_N` with automatic naming), atomically; returns the folder."""
        return checkpoint_state.save_state(self, output_dir, safe_serialization, list(self._save_state_pre_hooks.values()))

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
                   ) -> str:  # fmt: skip
        """Restores what `save_state` saved (default: the latest numbered checkpoint); returns the folder.

        `load_kwargs` go to `torch.load` (weights_only=True unless they say otherwise); `strict=False` lets the
        models' weights differ in names from the checkpoint's.
        """
        strict = load_model_func_kwargs.pop("strict", True)
        return checkpoint_state.load_state(self, input_dir, load_kwargs, list(self._load_state_pre_hooks.values()),
                                           strict=strict)  # fmt: skip

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Adds objects with `state_dict` / `load_state_dict` to what save_state / load_state cover."""
        invalid = [f"{i}: {type(obj).__name__}" for i, obj in enumerate(objects)
                   if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))]  # fmt: skip
        if invalid:
            raise ValueError("register_for_checkpointing needs objects with state_dict and load_state_dict; "
                             f"these have not: {', '.join(invalid)}")  # fmt: skip
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

    save_iteration = property(lambda self: self.project_configuration.iteration,
                              doc="The number the next automatically named checkpoint gets.")  # fmt: skip

    def free_memory(self, *objects: Any) -> tuple:
        """Drops the references this Accelerator holds (and returns `objects` as None), then frees caches."""
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    clear = free_memory

    def end_training(self) -> None:
        self.state.destroy_process_group()


FORWARDED_TO_STATE = frozenset(
    {
        "wait_for_everyone", "print", "main_process_first", "local_main_process_first", "split_between_processes",
        "on_main_process", "on_local_main_process", "on_last_process", "on_process", "on_local_process",
    }
)  # fmt: skip


def _all_tensors(data: Any) -> bool:
    """Whether every leaf is a tensor (any Mapping, so transformers' BatchEncoding/ModelOutput count)."""
    try:
        collectives.recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


__all__ = ["Accelerator"]
