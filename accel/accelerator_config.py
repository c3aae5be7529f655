"""The dataclasses users hand to `Accelerator`, with HF Accelerate's names, fields and defaults.

`accel.utils` and `accel.utils.dataclasses` re-export them, so `from accelerate.utils import
DistributedDataParallelKwargs` keeps working with only the package name changed.
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import timedelta
from typing import Any, Literal

from accel.env_vars import get_flag, get_setting


class KwargsHandler:
    """A dataclass mixin whose `to_kwargs()` gives the fields that differ from the class defaults (as HF)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_kwargs(self) -> dict[str, Any]:
        defaults = {f.name: default_of(f) for f in dataclasses.fields(self)}
        return {k: v for k, v in self.to_dict().items() if defaults[k] != v}


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


class EnumWithContains(enum.EnumMeta):
    """An enum metaclass for which `"value" in MyEnum` tests the values, as HF Accelerate's enums allow."""

    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=EnumWithContains):
    """HF Accelerate's enum base: `str()` is the value, `list()` the values, `in` tests a value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list:
        """Every value, in definition order."""
        return [member.value for member in cls]


class PrecisionType(str, BaseEnum):
    """The `mixed_precision` modes. accel trains in "no", "fp16" and "bf16"; "fp8" is refused when used."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class ComputeEnvironment(str, enum.Enum):
    """Where a config file says training runs (the `compute_environment` key)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker's distributed modes (a config file's `distributed_type` under SageMaker; accel does not run them)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class FP8BackendType(str, enum.Enum):
    """The FP8 engines of HF Accelerate (accel runs none of them: `Accelerator.fp8_backend` reports the setting)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class CustomDtype(enum.Enum):
    """Sizes `infer_auto_device_map` accepts besides torch dtypes (weights quantized by other libraries)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for `torch.nn.parallel.DistributedDataParallel`, plus a gradient communication hook."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def ddp_kwargs(self) -> dict[str, Any]:
        """The changed arguments DDP's constructor takes (the hook fields are not among them)."""
        hook_fields = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in self.to_kwargs().items() if k not in hook_fields}

    def register_comm_hook(self, model: Any) -> None:
        """Registers the configured hook (optionally wrapped in fp16/bf16 compression) on a DDP model."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
        }
        hook = hooks.get(DDPCommunicationHookType(self.comm_hook))
        if hook is None:
            return
        wrapper = wrappers.get(DDPCommunicationHookType(self.comm_wrapper))
        power_sgd = self.comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
        state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option) if power_sgd else None
        model.register_comm_hook(state=state, hook=wrapper(hook) if wrapper else hook)


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`; `timeout` bounds every cross-process wait."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for `torch.autocast` in mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for the fp16 gradient scaler (`torch.amp.GradScaler`), as in HF Accelerate."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


PROFILE_PATTERN_NAME = "profile_{suffix}.json"  # HF Accelerate's trace file name; the suffix is the process index


# HF's name for the activities ProfileKwargs takes.
ProfilerActivity = Literal["cpu", "xpu", "mtia", "cuda", "hpu"]


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of `torch.profiler.profile` for `Accelerator.profile()` (HF Accelerate's fields and defaults).

    Args:
        activities: "cpu", "cuda", "xpu", "mtia", "hpu" (those this torch and machine have); None: torch's default.
        schedule_option: `torch.profiler.schedule` arguments (wait, warmup, active, repeat, skip_first).
        on_trace_ready: called by torch when a scheduled recording is ready.
        record_shapes, profile_memory, with_stack, with_flops, with_modules: as `torch.profiler.profile`.
        output_trace_dir: where each process writes its Chrome trace, `profile_<process index>.json`.

    Example:
        ```python
        accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir="trace")])
        with accelerator.profile() as prof:
            train_step()
        print(prof.key_averages().table())
        ```
    """

    activities: list[ProfilerActivity] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def _get_profiler_activity(self, activity: str) -> Any:
        """The `torch.profiler.ProfilerActivity` named `activity`; a ValueError lists those available here."""
        import torch

        available = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        for name in ("xpu", "mtia", "hpu"):
            backend = getattr(torch, name, None)
            if (
                backend is not None
                and backend.is_available()
                and hasattr(torch.profiler.ProfilerActivity, name.upper())
            ):
                available[name] = getattr(torch.profiler.ProfilerActivity, name.upper())
        if activity not in available:
            raise ValueError(f"Invalid profiler activity: {activity}. Must be one of {list(available)}.")
        return available[activity]

    def build(self) -> Any:
        """A `torch.profiler.profile` with these settings (not started)."""
        import torch

        activities = None if self.activities is None else [self._get_profiler_activity(a) for a in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients accumulate.

    Unlike HF Accelerate, `to_kwargs()` of this plugin returns every field, so the documented defaults
    (`adjust_scheduler=True`) are the ones in effect; HF drops unchanged fields and GradientState then
    falls back to `adjust_scheduler=False`.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = self.to_dict()
        if kwargs["num_steps"] is None:
            del kwargs["num_steps"]
        return kwargs


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How prepared dataloaders shard, dispatch and place batches."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project saves checkpoints and logs, and how saves wait (accel's fields, not HF's):

    `async_save`: `save_state` / `save_model` return after an in-memory snapshot and write in the background
    (joined by the next save, `load_state`, `end_training` and `Accelerator.wait_for_checkpoint()`, which raise a
    failure). `durable_save`: they return only once the files are fsync'd. Neither (the default): they return once
    the files are complete, and fsync follows in the background. See accel.checkpoint.background.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False
    durable_save: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


class DynamoBackend(str, enum.Enum):
    """HF Accelerate's torch.compile backends; the one list (the config file and launcher check against it)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


@dataclasses.dataclass
class TorchDynamoPlugin(KwargsHandler):
    """torch.compile settings; unset fields come from ACCEL_DYNAMO_* (what `accel launch` exports)."""

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        self.backend = DynamoBackend(str(self.backend or get_setting("DYNAMO_BACKEND", "no")).upper())
        self.mode = self.mode or get_setting("DYNAMO_MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = get_flag("DYNAMO_USE_FULLGRAPH")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = get_flag("DYNAMO_USE_REGIONAL_COMPILATION")
        if self.dynamic is None and get_setting("DYNAMO_USE_DYNAMIC") is not None:
            self.dynamic = get_flag("DYNAMO_USE_DYNAMIC")

    @property
    def enabled(self) -> bool:
        return self.backend != DynamoBackend.NO and not self.disable

    def compile_kwargs(self) -> dict[str, Any]:
        """The arguments for torch.compile (`mode="default"` is passed as None, as torch expects)."""
        kwargs = {"backend": self.backend.value.lower(), "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode and self.mode != "default":
            kwargs["mode"] = self.mode
        if self.options:
            kwargs["options"] = self.options
        return kwargs


def gradient_accumulation_steps_from_env(default: int) -> int:
    """ACCEL_GRADIENT_ACCUMULATION_STEPS (what `accel launch --gradient_accumulation_steps` exports), else `default`."""
    value = get_setting("GRADIENT_ACCUMULATION_STEPS")
    return default if not value else int(value)
