"""Process state: which process this is, how many there are, its device, and how processes wait for each other.

Three singletons share their state between all instances (Alex Martelli's "Borg"), as in HF Accelerate:

- `PartialState`: the process group and device; usable on its own, without an `Accelerator`.
- `AcceleratorState`: `PartialState` plus the training configuration (mixed precision, dynamo plugin).
- `GradientState`: gradient accumulation and dataloader bookkeeping (`accel.gradient_state`, re-exported here).

The process group comes from the environment `torchrun` (`accel launch`) exports: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (starting it, its timeout and its barrier:
`accel.wire.process_group`), or,
for a script srun starts once per process without a launcher, from the step's SLURM_* variables (`accel.slurm`).
Unlike HF Accelerate, several CPU processes are `MULTI_CPU` without `cpu=True`: when CUDA is unavailable the
processes simply use gloo on the CPU. When they all run on one host, the group's CPU collectives then go through
shared memory instead of TCP (`accel.wire.process_group` layers `accel.wire.shm_process_group` on gloo, for a group
it starts as for one someone else initialized; ACCEL_TRANSPORT=torch keeps plain gloo).
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import warnings
from contextlib import contextmanager
from datetime import timedelta
from functools import partial, wraps
from typing import Any, Callable

import torch
import torch.distributed as dist

from accel import slurm
from accel.backends.checks import refuse_unsupported_arguments, refuse_unsupported_environment
from accel.cpu_affinity import set_numa_affinity
from accel.env_vars import MIXED_PRECISIONS, get_flag, get_setting
from accel.gradient_state import GradientState
from accel.unsupported import refuse
from accel.wire import process_group, uneven
from accel.wire.gloo_workers import wait_for_gloo_workers_at_exit
from accel.wire.transport_selection import select_transport

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState", "is_initialized"]


class DistributedType(str, enum.Enum):
    """The kind of distributed environment (HF Accelerate's names; JSON-serializable as a `str`).

    accel produces `NO` (one process), `MULTI_CPU` (gloo) and `MULTI_GPU` (NCCL); the other members exist so that
    code comparing against them keeps working.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    TP = "TP"


def is_initialized() -> bool:
    """Whether an `AcceleratorState` has been created (by an `Accelerator`), as a module-level function."""
    return "_mixed_precision" in AcceleratorState._shared_state


def do_nothing(*args, **kwargs) -> None:
    """Takes anything, does nothing, returns None (what `on_main_process` & co. give the other processes)."""
    return None


class ThreadLocalSharedDict(threading.local):
    """A descriptor holding one dict per thread, shared by every instance of the class it is set on (HF's).

    `Class._shared_state` and `instance._shared_state` both give the current thread's dict, and assigning through an
    instance replaces it; assigning on the class replaces the descriptor itself, so clear it in place instead.
    HF Accelerate uses it as the singletons' shared state under PJRT's multithreaded XLA (TPU v2/v3), which accel
    does not run.

    Args:
        thread_local: Unused; HF's signature.
    """

    def __init__(self, thread_local: bool = False):
        self._storage = {}

    def __get__(self, obj: Any, objtype: type | None = None) -> dict:
        return self._storage

    def __set__(self, obj: Any, value: dict) -> None:
        self._storage = value


# The type of the singletons' shared state: a plain dict, shared by all threads (HF switches to
# ThreadLocalSharedDict when torch_xla is installed; accel does not run XLA, so there is no such case).
SharedDict = dict


# --- Resolving the environment once ------------------------------------------------------------------------------


def _distributed_fields(use_cuda: bool, timeout: timedelta | None) -> dict:
    local_rank = process_group.local_rank()
    return {
        "backend": dist.get_backend(),
        "distributed_type": DistributedType.MULTI_GPU if use_cuda else DistributedType.MULTI_CPU,
        "num_processes": dist.get_world_size(),
        "process_index": dist.get_rank(),
        "local_process_index": local_rank,
        "device": process_group.device_for(True, use_cuda, local_rank),
        "_timeout": timeout or process_group.group_timeout(),
    }


def _single_process_fields(use_cuda: bool, timeout: timedelta | None) -> dict:
    return {
        "backend": None,
        "distributed_type": DistributedType.NO,
        "num_processes": 1,
        "process_index": 0,
        "local_process_index": 0,
        "device": process_group.device_for(False, use_cuda, 0),
        "_timeout": timeout or dist.default_pg_timeout,
    }


def _adopt_srun_task() -> None:
    """A process srun started as one task of several (`srun python script.py`, no launcher) exports its rank,
    world size and rendezvous from the SLURM_* variables (`accel.slurm.task_environment`), as torchrun would have,
    so the group starts from them; HF Accelerate does the same for MPI launchers' variables. Anything a launcher
    set already is left alone."""
    variables = slurm.task_environment(os.environ)
    if variables is not None:
        os.environ.update(variables)


# --- split_between_processes -------------------------------------------------------------------------------------


def _pin_cpus(local_process_index: int) -> None:
    """With ACCEL_CPU_AFFINITY (HF: ACCELERATE_CPU_AFFINITY) set, pins this process to its CPUs, as HF's
    PartialState does (`accel.cpu_affinity.set_numa_affinity`: once per process, so a process `accel launch`'s
    worker pinned already is not pinned again)."""
    if get_flag("CPU_AFFINITY"):
        set_numa_affinity(local_process_index)


def _shard_bounds(length: int, num_processes: int, process_index: int) -> tuple[int, int]:
    """[start, end) of this process's contiguous shard: the first `length % num_processes` shards get one more."""
    per_process, extras = divmod(length, num_processes)
    start = process_index * per_process + min(process_index, extras)
    return start, start + per_process + (1 if process_index < extras else 0)


def _common_length(inputs: Any) -> int:
    if not isinstance(inputs, dict):
        return len(inputs)
    lengths = {key: _common_length(value) for key, value in inputs.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"All values in the dictionary must have the same length, got {lengths}")
    return next(iter(lengths.values()), 0)


def _pad_with_last(shard: Any, inputs: Any, padded_length: int | None) -> Any:
    missing = 0 if padded_length is None else padded_length - len(shard)
    if missing <= 0 or len(inputs) == 0:
        return shard
    if isinstance(shard, torch.Tensor):
        return torch.cat([shard, inputs[-1:].expand(missing, *inputs.shape[1:])])
    return shard + type(shard)([inputs[-1]] * missing)


def _take_dataset(dataset: Any, start: int, end: int, padded_length: int | None) -> Any:
    indices = list(range(min(start, len(dataset)), min(end, len(dataset))))
    return dataset.select(_pad_with_last(indices, range(len(dataset)), padded_length))


def _is_dataset(inputs: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(inputs, datasets.Dataset)


def _take(inputs: Any, start: int, end: int, padded_length: int | None) -> Any:
    if isinstance(inputs, dict):
        return {key: _take(value, start, end, padded_length) for key, value in inputs.items()}
    if isinstance(inputs, (list, tuple, torch.Tensor)):
        return _pad_with_last(inputs[start:end], inputs, padded_length)
    if _is_dataset(inputs):
        return _take_dataset(inputs, start, end, padded_length)
    return inputs


def _split_inputs(inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False) -> Any:
    """The part of `inputs` that `split_between_processes` hands to `process_index` (a pure function)."""
    if num_processes == 1:
        return inputs
    length = _common_length(inputs)
    start, end = _shard_bounds(length, num_processes, process_index)
    padded_length = -(-length // num_processes) if apply_padding else None
    return _take(inputs, start, end, padded_length)


# --- PartialState ------------------------------------------------------------------------------------------------


class PartialState:
    """The process group and device of this process, shared by every instance (a singleton).

    Usable without an `Accelerator`. The first instance resolves everything once:

    - launched by torchrun / `accel launch` (LOCAL_RANK or WORLD_SIZE > 1 in the environment): initializes the
      default process group, NCCL on `cuda:LOCAL_RANK` when CUDA is available, else gloo on the CPU
      (`MULTI_GPU` / `MULTI_CPU`). A process group someone else already initialized (the user's
      `init_process_group`, Ray Train, torchrun without `accel launch`) is adopted: its ranks, store and timeout are
      kept, and, like a group accel starts, it moves CPU tensors through shared memory when its ranks share one
      host (`accel.wire.process_group.adopt_default_group`: a collective, so every rank creates its `PartialState`).
    - started by srun as one of several tasks, without a launcher (`srun python script.py`): the same, with the
      rank, local rank and world size from SLURM_PROCID, SLURM_LOCALID and the step's task count, exported as
      RANK, LOCAL_RANK, WORLD_SIZE, ... (`accel.slurm.task_environment`).
    - otherwise: one process (`DistributedType.NO`) on the CPU or the current CUDA device.

    Args:
        cpu: Run on the CPU even when CUDA is available (ACCEL_USE_CPU=1 does the same).
        **kwargs: Passed to `torch.distributed.init_process_group` (what `InitProcessGroupKwargs.to_kwargs()`
            gives): `backend` overrides nccl/gloo; `timeout` (a `timedelta`, or seconds) bounds every
            cross-process wait, else ACCEL_PROCESS_GROUP_TIMEOUT (seconds), else torch's default.

    Example:
        ```python
        state = PartialState()
        print(state.process_index, state.num_processes, state.device)
        ```
    """

    _shared_state: dict = SharedDict()
    _known_attrs = [
        "_cpu",
        "_shared_state",
        "_timeout",
        "backend",
        "debug",
        "device",
        "distributed_type",
        "local_process_index",
        "num_processes",
        "process_index",
    ]

    def __init__(self, cpu: bool = False, **kwargs):
        self.__dict__ = self._shared_state
        if not self.initialized:
            self._initialize(cpu or get_flag("USE_CPU"), dict(kwargs))

    @property
    def fork_launched(self) -> bool:
        """Whether notebook_launcher forked this process (read when asked: every collective builds this object,
        and a fork may set the variable after the state was first made)."""
        return get_flag("FORK_LAUNCHED")

    def _initialize(self, cpu: bool, kwargs: dict) -> None:
        # Everything is resolved into `fields` first, so a failure leaves the singleton uninitialized.
        use_cuda = process_group.wants_cuda(cpu)
        backend = kwargs.pop("backend", None) or ("nccl" if use_cuda else "gloo")
        timeout = process_group.requested_timeout(kwargs.pop("timeout", None))
        debug = get_flag("DEBUG_MODE")
        if not dist.is_initialized():
            _adopt_srun_task()
        if not dist.is_initialized() and process_group.launched_distributed(use_cuda):
            local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))
            device = process_group.device_for(True, use_cuda, local_rank)
            process_group.start_process_group(backend, timeout, device, kwargs)
        if dist.is_initialized():
            wait_for_gloo_workers_at_exit()  # the group started above, or the user's: DDP runs on its gloo threads
            process_group.adopt_default_group()  # the same for both: local placement, shared memory on one host
            fields = _distributed_fields(use_cuda, timeout)
        else:
            fields = _single_process_fields(use_cuda, timeout)
        fields.update(_cpu=cpu, debug=debug)
        self._shared_state.update(fields)
        _pin_cpus(self.local_process_index)

    def __repr__(self) -> str:
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (
            f"Distributed environment: {self.distributed_type}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forgets the shared state (the process group is left as it is); internal and test use only."""
        PartialState._shared_state.clear()

    @property
    def initialized(self) -> bool:
        """Whether the shared state has been set up."""
        return self._shared_state != {}

    @property
    def timeout(self) -> timedelta:
        """The deadline of every cross-process wait: the process group's timeout."""
        return self._timeout

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_last_process(self) -> bool:
        """Whether this is the process with the highest index."""
        return self.process_index == self.num_processes - 1

    @property
    def is_main_process(self) -> bool:
        """Whether this is process 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is process 0 of its machine."""
        return self.local_process_index == 0

    @property
    def default_device(self) -> torch.device:
        """`cuda` when CUDA is available, else `cpu` (the device a single process would pick)."""
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def set_device(self) -> None:
        """Sets `device` for this process if it is not set yet (the first instance already sets it): the CPU, the
        current CUDA device (one process) or `cuda:LOCAL_RANK`, or ACCEL_TORCH_DEVICE."""
        if self.__dict__.get("device") is not None:
            return
        use_cuda = process_group.wants_cuda(self._cpu)
        distributed = self.distributed_type != DistributedType.NO
        self.device = process_group.device_for(distributed, use_cuda, self.local_process_index)

    def wait_for_everyone(self) -> None:
        """Blocks until every process reaches this point; does nothing in a single process.

        Bounded by `timeout`: a process that never arrives makes the others raise instead of hanging. With
        ACCEL_DEBUG_MODE=1 on gloo the error names the missing ranks (`monitored_barrier`).

        Example:
            ```python
            state = PartialState()
            if state.is_main_process:
                save_checkpoint()  # rank 0 writes...
            state.wait_for_everyone()
            load_checkpoint()  # rank 0 and rank 1 read it afterwards
            ```
        """
        if self.backend is None:
            return
        if uneven.in_uneven_step():  # the exchange with the processes standing by is the barrier
            uneven.exchange("wait_for_everyone")
        elif self.debug:  # gloo's monitored barrier names the ranks that did not arrive
            process_group.barrier(self.backend, self.device, self.timeout, self.debug)
        else:
            select_transport([]).barrier()

    def _goes_first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self):
        """Runs the block on the main process first; the others enter it once the main process has left it.

        Example:
            ```python
            with state.main_process_first():
                dataset = load_or_download()  # rank 0 downloads; rank 1 and rank 2 then read the cache
            ```
        """
        yield from self._goes_first(self.is_main_process)

    @contextmanager
    def local_main_process_first(self):
        """Runs the block on each machine's local main process first, then on the other local processes.

        Example:
            ```python
            with state.local_main_process_first():
                tokenizer = build_cache()  # local rank 0 first, then local ranks 1..N-1
            ```
        """
        yield from self._goes_first(self.is_local_main_process)

    @contextmanager
    def split_between_processes(self, inputs: list | tuple | dict | torch.Tensor, apply_padding: bool = False):
        """Gives each process its contiguous share of `inputs` (for distributed inference).

        The first `len(inputs) % num_processes` processes get one element more. No communication happens.
        A dict is split value by value (all values, nested dicts included, need the same length) into a new
        dict; the input is not modified. Other types are returned whole; with one process `inputs` is returned
        as is.

        Args:
            inputs: A list, tuple, tensor (split along dim 0), dict of those, or a `datasets.Dataset`.
            apply_padding: Repeat the last element of `inputs` so every process gets `ceil(len / num_processes)`
                elements (needed before a `gather`); drop the padding afterwards.

        Example:
            ```python
            with state.split_between_processes(["A", "B", "C"]) as shard:
                print(shard)  # rank 0: ["A", "B"]   rank 1: ["C"]
            with state.split_between_processes(["A", "B", "C"], apply_padding=True) as shard:
                print(shard)  # rank 0: ["A", "B"]   rank 1: ["C", "C"]
            ```
        """
        yield _split_inputs(inputs, self.num_processes, self.process_index, apply_padding)

    def on_main_process(self, function: Callable[..., Any] | None = None):
        """Decorator: `function` runs on the main process only (on every process when not distributed)."""
        if not self.initialized:
            raise ValueError("The `PartialState` or `Accelerator` must be initialized before calling this function.")
        return self._only_if(self.is_main_process, function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None):
        """Decorator: `function` runs on each machine's local main process only."""
        return self._only_if(self.is_local_main_process, function)

    def on_last_process(self, function: Callable[..., Any]):
        """Decorator: `function` runs on the last process only."""
        return self._only_if(self.is_last_process, function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None):
        """Decorator: `function` runs on the process `process_index` only.

        Example:
            ```python
            @state.on_process(process_index=2)
            def report():
                print("only rank 2 prints this")
            ```
        """
        if function is None:
            return partial(self.on_process, process_index=process_index)
        return self._only_if(self.process_index == process_index, function)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int | None = None):
        """Decorator: `function` runs on the process with local index `local_process_index` of each machine."""
        if function is None:
            return partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(self.local_process_index == local_process_index, function)

    def _only_if(self, selected: bool, function: Callable[..., Any]):
        return function if selected or not self.use_distributed else do_nothing

    def print(self, *args, **kwargs) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group=None) -> None:
        """Destroys `group` (default: the default process group); not under notebook_launcher's fork."""
        if self.fork_launched and group is None:
            return
        if dist.is_initialized():
            dist.destroy_process_group(group)

    def __getattr__(self, name: str):
        if name in self._known_attrs:
            raise AttributeError(
                f"`PartialState` object has no attribute `{name}`. This happens if `PartialState._reset_state()` "
                "was called and an `Accelerator` or `PartialState` was not reinitialized."
            )
        raise AttributeError(f"'PartialState' object has no attribute '{name}'")


# --- AcceleratorState --------------------------------------------------------------------------------------------


def _resolve_mixed_precision(mixed_precision: str | None) -> str:
    """The argument, else ACCEL_MIXED_PRECISION, else "no"; validated."""
    source = "mixed_precision"
    if mixed_precision is None:
        source = "ACCELERATE_MIXED_PRECISION" if "ACCEL_MIXED_PRECISION" not in os.environ else "ACCEL_MIXED_PRECISION"
        mixed_precision = get_setting("MIXED_PRECISION", "no")
    value = mixed_precision.strip().lower() if isinstance(mixed_precision, str) else mixed_precision
    if value not in MIXED_PRECISIONS:
        choices = ", ".join(repr(choice) for choice in MIXED_PRECISIONS)
        raise ValueError(f"{source}={mixed_precision!r} is not a mixed precision mode; choose one of {choices}.")
    return value


def _refuse_unsupported(plugins: dict, mixed_precision_given: bool) -> None:
    """Refuses plugins and launcher variables asking for backends accel does not run (accel.backends.checks)."""
    refuse_unsupported_arguments(**plugins)
    refuse_unsupported_environment(mixed_precision_given)


def _refuse_unrunnable_deepspeed(plugin: Any, device: torch.device) -> None:
    """What DeepSpeed cannot run here, refused before anything starts: fp16 on CPU processes (DeepSpeed's CPU
    accelerator has no fp16 support), NVMe offload without DeepSpeed's async I/O op (libaio)."""
    config = plugin.deepspeed_config
    if device.type == "cpu" and config.get("fp16", {}).get("enabled", False) is True:
        raise ValueError(
            "DeepSpeed does not support fp16 on CPU processes (its CPU accelerator has no fp16 "
            "optimizer or loss scaler): use mixed_precision='bf16' (or 'no')"
        )
    zero = config.get("zero_optimization", {})
    for part in ("offload_optimizer", "offload_param"):
        if (zero.get(part) or {}).get("device") == "nvme" and not _nvme_offload_available():
            raise refuse(
                "DeepSpeed NVMe offload",
                f"zero_optimization.{part}.device='nvme'",
                "offload to 'cpu' (or 'none'); NVMe offload needs libaio and DeepSpeed's async_io op",
            )


def _nvme_offload_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _forwarded_method(method: Callable) -> Callable:
    """An `AcceleratorState` method that calls the same `PartialState` method."""

    @wraps(method)
    def forward(self, *args, **kwargs):
        return method(PartialState(), *args, **kwargs)

    return forward


def _forwarded_property(name: str, doc: str | None = None) -> property:
    """An `AcceleratorState` property that reads the same `PartialState` attribute."""
    return property(lambda self: getattr(PartialState(), name), doc=doc or getattr(PartialState, name).__doc__)


class AcceleratorState:
    """`PartialState` plus the training configuration, shared by every instance (a singleton).

    Created by `Accelerator` (`_from_accelerator=True`); creating it directly raises, as in HF Accelerate. The
    process attributes (`device`, `num_processes`, `process_index`, `distributed_type`, ...) are copies of
    `PartialState`'s, and its methods forward to `PartialState`.

    FSDP (a plugin, or ACCEL_USE_FSDP) makes the distributed type FSDP; DeepSpeed (one plugin, a dict of named
    ones, or ACCEL_USE_DEEPSPEED) makes it DEEPSPEED, with the first plugin selected. Megatron-LM,
    tensor/context parallelism and fp8 are refused with `UnsupportedFeatureError` (as plugins or as
    ACCEL_USE_MEGATRON_LM / ACCEL_MIXED_PRECISION=fp8).

    Args:
        mixed_precision: "no", "fp16" or "bf16"; None reads ACCEL_MIXED_PRECISION (default "no").
        cpu: Run on the CPU even when CUDA is available (ACCEL_USE_CPU=1 does the same).
        dynamo_plugin: The `TorchDynamoPlugin`, stored as given.
        deepspeed_plugin: A `DeepSpeedPlugin`, or a dict of named ones (the first is selected).
        fsdp_plugin: A `FullyShardedDataParallelPlugin`.
        torch_tp_plugin, megatron_lm_plugin: HF Accelerate's plugins, refused (a `TorchTensorParallelPlugin` with
            tp_size 1 asks for nothing and is kept).
        parallelism_config: A `ParallelismConfig`; accepted when it asks for data parallelism only.
        _from_accelerator: Set by `Accelerator`.
        **kwargs: Passed to `PartialState` (process group options).
    """

    _shared_state: dict = SharedDict()
    _known_attrs = PartialState._known_attrs + ["_mixed_precision", "dynamo_plugin"]

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin=None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        parallelism_config=None,
        _from_accelerator: bool = False,
        **kwargs,
    ):
        self.__dict__ = self._shared_state
        cpu = cpu or get_flag("USE_CPU")
        if not self.initialized:
            plugins = dict(
                deepspeed_plugin=deepspeed_plugin,
                fsdp_plugin=fsdp_plugin,
                torch_tp_plugin=torch_tp_plugin,
                megatron_lm_plugin=megatron_lm_plugin,
                parallelism_config=parallelism_config,
                mixed_precision=mixed_precision,
            )
            _refuse_unsupported(plugins, mixed_precision_given=mixed_precision is not None)
            mixed_precision = _resolve_mixed_precision(mixed_precision)
            if not _from_accelerator:
                raise ValueError(
                    "Please make sure to properly initialize your accelerator via `accelerator = Accelerator()` "
                    "before using any functionality from the `accel` library."
                )
        PartialState(cpu, **kwargs)
        self.__dict__.update(PartialState._shared_state)
        self._check_initialized(mixed_precision, cpu)
        if not self.initialized:
            self.dynamo_plugin = dynamo_plugin
            self.deepspeed_plugins = self._use_deepspeed(deepspeed_plugin, mixed_precision)
            self.fsdp_plugin = self._use_fsdp(fsdp_plugin, mixed_precision)
            self.megatron_lm_plugin = None
            self.torch_tp_plugin = torch_tp_plugin
            self.parallelism_config = parallelism_config
            self.device_mesh = None  # DDP needs no device mesh
            self._mixed_precision = mixed_precision

    def _use_deepspeed(self, plugins: Any, mixed_precision: str) -> Any:
        """The DeepSpeed plugin(s) when DeepSpeed runs (`plugins`, or one built from the ACCEL(ERATE)_DEEPSPEED_*
        variables when ACCEL_USE_DEEPSPEED / ACCELERATE_USE_DEEPSPEED says so), with the distributed type DEEPSPEED
        (one process too, as HF), each plugin's mixed precision set and the first selected; None otherwise."""
        from accel.backends.deepspeed import DeepSpeedPlugin, require_deepspeed

        if plugins is None and get_flag("USE_DEEPSPEED"):
            plugins = DeepSpeedPlugin()
        if plugins is None:
            return None
        require_deepspeed()
        named = plugins if isinstance(plugins, dict) else {"default": plugins}
        if not named or any(not isinstance(plugin, DeepSpeedPlugin) for plugin in named.values()):
            raise TypeError("`deepspeed_plugin` must be a DeepSpeedPlugin object.")
        for plugin in named.values():
            plugin.set_mixed_precision(mixed_precision)
            _refuse_unrunnable_deepspeed(plugin, self.device)
        next(iter(named.values())).select(_from_accelerator_state=True)
        # HF's Accelerator says so in the environment: a TrainingArguments made later builds its DeepSpeed plugin.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
        return plugins

    def _use_fsdp(self, plugin: Any, mixed_precision: str) -> Any:
        """The FSDP plugin when FSDP runs (`plugin`, or one built from HF's FSDP_* variables when ACCEL_USE_FSDP /
        ACCELERATE_USE_FSDP says so), with the distributed type FSDP, as HF sets it; None otherwise. One process
        has nothing to shard across: it trains as it would without the plugin, saying so (HF ignores it)."""
        if plugin is None and get_flag("USE_FSDP"):
            from accel.backends.fsdp import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
        if plugin is None:
            return None
        if self.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(
                "FSDP and DeepSpeed cannot both run: pass one of `fsdp_plugin` and `deepspeed_plugin` "
                "(or set only one of ACCEL_USE_FSDP and ACCEL_USE_DEEPSPEED)"
            )
        if self.distributed_type == DistributedType.NO:
            warnings.warn(
                "FSDP shards a model across processes and this job has one: training without it (launch "
                "with --num_processes 2 or more to shard)"
            )
            return None
        # PartialState's too, as HF sets it: every later AcceleratorState() copies PartialState's attributes.
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        return plugin

    @property
    def initialized(self) -> bool:
        """Whether an `Accelerator` has set up the shared state."""
        return "_mixed_precision" in self._shared_state

    def _check_initialized(self, mixed_precision: str | None = None, cpu: bool | None = None) -> None:
        if not self.initialized:
            return
        err = (
            "AcceleratorState has already been initialized and cannot be changed, restart your runtime completely "
            "and pass `{flag}` to `Accelerator()`."
        )
        if cpu and self.device.type != "cpu":
            raise ValueError(err.format(flag="cpu=True"))
        changed = mixed_precision is not None and str(mixed_precision).lower() != self._mixed_precision
        if changed and self.distributed_type != DistributedType.DEEPSPEED:  # DeepSpeed's is in its config (HF)
            raise ValueError(err.format(flag=f"mixed_precision='{mixed_precision}'"))

    @property
    def mixed_precision(self) -> str:
        """ "no", "fp16", "bf16" or "fp8"; under DeepSpeed, what the active plugin's config enables (as HF)."""
        if self.distributed_type != DistributedType.DEEPSPEED:
            return self._mixed_precision
        config = self.deepspeed_plugin.deepspeed_config
        enabled = [dtype for dtype in ("fp16", "bf16") if config.get(dtype, {}).get("enabled", False) is True]
        return enabled[0] if enabled else "no"

    @property
    def deepspeed_plugin(self) -> Any:
        """The active (selected) DeepSpeed plugin; None without DeepSpeed."""
        if self.distributed_type != DistributedType.DEEPSPEED:
            return None
        from accel.backends.deepspeed import get_active_deepspeed_plugin

        return get_active_deepspeed_plugin(self)

    @property
    def is_fsdp2(self) -> bool:
        """Whether FSDP runs: always FSDP2 in accel (an fsdp_version=1 plugin is translated to it)."""
        return self.distributed_type == DistributedType.FSDP

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeed plugin passed under `name` (`deepspeed_plugins={name: plugin}`)."""
        self._require_deepspeed()
        return self.deepspeed_plugins[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Makes the plugin named `name` the active one (the next `prepare` builds its engine with it)."""
        self._require_deepspeed()
        for key, plugin in self.deepspeed_plugins.items():
            if key != name:
                plugin._unselect()
        self.deepspeed_plugins[name].select(_from_accelerator_state=True)

    def _require_deepspeed(self) -> None:
        if self.distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(
                "DeepSpeed is not enabled, please make sure that an `Accelerator` is configured for "
                "`deepspeed` before calling this function."
            )

    def __repr__(self) -> str:
        text = repr(PartialState()) + f"\nMixed precision type: {self.mixed_precision}\n"
        if self.distributed_type == DistributedType.DEEPSPEED:
            text += f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n"
        return text

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forgets the shared state (and `PartialState`'s too if asked); internal and test use only."""
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()

    fork_launched = _forwarded_property("fork_launched", "Whether notebook_launcher forked this process.")
    timeout = _forwarded_property("timeout")
    use_distributed = _forwarded_property("use_distributed")
    is_last_process = _forwarded_property("is_last_process")
    is_main_process = _forwarded_property("is_main_process")
    is_local_main_process = _forwarded_property("is_local_main_process")
    default_device = _forwarded_property("default_device")

    wait_for_everyone = _forwarded_method(PartialState.wait_for_everyone)
    main_process_first = _forwarded_method(PartialState.main_process_first)
    local_main_process_first = _forwarded_method(PartialState.local_main_process_first)
    split_between_processes = _forwarded_method(PartialState.split_between_processes)
    on_main_process = _forwarded_method(PartialState.on_main_process)
    on_local_main_process = _forwarded_method(PartialState.on_local_main_process)
    on_last_process = _forwarded_method(PartialState.on_last_process)
    on_process = _forwarded_method(PartialState.on_process)
    on_local_process = _forwarded_method(PartialState.on_local_process)
    print = _forwarded_method(PartialState.print)
    destroy_process_group = _forwarded_method(PartialState.destroy_process_group)

    def __getattr__(self, name: str):
        if name in self._known_attrs:
            raise AttributeError(
                f"`AcceleratorState` object has no attribute `{name}`. This happens if "
                "`AcceleratorState._reset_state()` was called and an `Accelerator` or `PartialState` was not "
                "reinitialized."
            )
        raise AttributeError(f"'AcceleratorState' object has no attribute '{name}'")
