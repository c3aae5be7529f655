"""Composable parallelism's names: `ParallelismConfig` and the tensor / context / sequence parallel configs.

accel runs data parallelism: replicated (DDP) and, with FSDP on, sharded. A `ParallelismConfig` that asks only
for those (`dp_replicate_size`, and `dp_shard_size` under FSDP: FSDP or HSDP over its device mesh, as HF builds
it) is accepted by `Accelerator`; one with tensor, context or sequence parallelism (`tp_size`, `cp_size`, `sp_size`
> 1), or `dp_shard_size` > 1 without FSDP, is refused, naming the size that asked.
The configs themselves build and validate as in HF Accelerate (PARALLELISM_CONFIG_* variables).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any

from accel.backends import DDP_INSTEAD
from accel.unsupported import refuse

_MESH_ORDER = ["dp_replicate", "dp_shard", "cp", "sp", "tp"]
SHARD_INSTEAD = "turn FSDP on to shard (fsdp_plugin=FullyShardedDataParallelPlugin(), accel launch --use_fsdp)"
_UNSUPPORTED_SIZES = {
    "tp_size": "tensor parallelism",
    "cp_size": "context parallelism",
    "sp_size": "sequence parallelism",
    "dp_shard_size": "sharded data parallelism (FSDP/HSDP)",
}


@dataclasses.dataclass
class TorchTensorParallelPlugin:
    """Deprecated tensor-parallel plugin (HF Accelerate): `tp_size` and a device mesh. accel refuses tp_size > 1."""

    tp_size: int = 1
    torch_device_mesh: Any = None


@dataclasses.dataclass
class TorchTensorParallelConfig:
    """Torch tensor-parallelism options of a `ParallelismConfig` (`enable_async_tp` is ignored with a warning,
    as in HF Accelerate)."""

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn("Async tensor parallelism is currently not supported, ignoring this option.")


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Torch context-parallelism options: `cp_comm_strategy` "allgather" (default,
    PARALLELISM_CONFIG_CP_COMM_STRATEGY) or "alltoall"."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of 'allgather' or 'alltoall'."
            )


@dataclasses.dataclass
class DeepSpeedSequenceParallelConfig:
    """DeepSpeed (Ulysses) sequence-parallelism options, from PARALLELISM_CONFIG_SP_* when unset (HF's checks)."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            variable = os.environ.get("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "true")
            self.sp_seq_length_is_variable = variable.lower() == "true"
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            if "PARALLELISM_CONFIG_SP_SEQ_LENGTH" not in os.environ:
                raise ValueError(
                    "when `sp_seq_length_is_variable` is `False` `sp_seq_length` must be provided either "
                    "through the constructor or the environment variable PARALLELISM_CONFIG_SP_SEQ_LENGTH"
                )
            length = os.environ["PARALLELISM_CONFIG_SP_SEQ_LENGTH"]
            self.sp_seq_length = None if length == "None" else int(length)
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", None)
        _check_sp_attention(self.sp_attn_implementation)


def _check_sp_attention(implementation: str | None) -> None:
    builtin = ["flash_attention_2", "flash_attention_3", "sdpa"]
    if implementation is None or implementation in builtin:
        return
    if implementation in ("eager", "flex_attention"):
        raise ValueError(
            f"Invalid sp_attn_implementation: {implementation}. 'eager' and 'flex_attention' are not "
            "supported with sequence parallelism."
        )
    if "/" not in implementation or "flash-attn" not in implementation:  # a hub-hosted flash attention kernel
        raise ValueError(
            f"Invalid sp_attn_implementation: {implementation}. Must be one of {builtin} or a hub-hosted "
            "flash attention kernel (e.g. 'kernels-community/flash-attn2')."
        )


def _size_from_env(name: str) -> int:
    return int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1"))


@dataclasses.dataclass
class ParallelismConfig:
    """The sizes of each parallelism dimension (HF Accelerate's fields, PARALLELISM_CONFIG_* defaults, checks).

    `dp_replicate_size` × `dp_shard_size` × `tp_size` × `cp_size` × `sp_size` must equal the number of
    processes. accel runs the data-parallel replication of that product (DDP); see the module docstring.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None
    device_mesh = None  # class attribute, as in HF: not a constructor argument

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            if getattr(self, name) is None:
                setattr(self, name, _size_from_env(name))
        self.cp_backend = self.cp_backend or os.environ.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        self.sp_backend = self.sp_backend or os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        self._default_handlers()
        self._check_sizes()
        self._sizes = {
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "tp": self.tp_size,
            "cp": self.cp_size,
            "sp": self.sp_size,
        }

    def _default_handlers(self) -> None:
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ValueError(
                    f"ParallelismConfig's cp_backend={self.cp_backend} requires TorchContextParallelConfig, "
                    f"but cp_handler was set to {type(self.cp_handler)}"
                )
        if self.sp_size > 1 and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()

    def _check_sizes(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, but got {getattr(self, name)}")
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend must be one of ['torch'], but got {self.cp_backend}")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be one of ['deepspeed'], but got {self.sp_backend}")
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(
                "Context Parallelism (CP) and Sequence Parallelism (SP) are mutually exclusive. Got "
                f"cp_size={self.cp_size} and sp_size={self.sp_size}. Please set either cp_size=1 or sp_size=1."
            )
        if (self.tp_size > 1 or self.cp_size > 1) and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                "Tensor/Context parallelism (tp/cp_size > 1) cannot be used with pure data parallelism "
                "(dp_replicate_size > 1 and dp_shard_size == 1)."
            )

    def __repr__(self) -> str:
        fields = [
            "dp_replicate_size",
            "dp_shard_size",
            "tp_size",
            "cp_size",
            "cp_backend",
            "sp_size",
            "sp_backend",
            "total_size",
            "tp_handler",
            "cp_handler",
        ]
        return "ParallelismConfig(\n" + "".join(f"\t{name}={getattr(self, name)},\n" for name in fields) + ")"

    def to_json(self) -> dict:
        """The configuration as a plain dict (the device mesh left out). HF's returns None; this returns it."""
        return copy.deepcopy(
            {
                key: copy.deepcopy(value.__dict__) if hasattr(value, "__dict__") else value
                for key, value in self.__dict__.items()
                if key != "device_mesh"
            }
        )

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dimensions across which data parallelism is applied."""
        return [
            name
            for name, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled))
            if on
        ]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions that receive the same batch."""
        return [name for name, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions flattened into the mesh FSDP shards the model across."""
        return [name for name, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions the loss is averaged across."""
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Dimensions FSDP is applied across."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    def _get_mesh(self) -> tuple:
        """(dimension names, sizes) of the enabled dimensions, in torchtitan's canonical order."""
        dims = sorted(
            ((name, self._sizes[name]) for name in self.active_mesh_dims), key=lambda d: _MESH_ORDER.index(d[0])
        )
        return tuple(zip(*dims))

    def build_device_mesh(self, device_type: str) -> Any:
        """A torch `DeviceMesh` over the enabled dimensions (None when none is), with HF's flattened dims."""
        if self.sp_backend == "deepspeed" and self.sp_size > 1:
            return None
        mesh = self._get_mesh()
        if len(mesh) == 0:
            return None
        names, shape = mesh
        device_mesh = init_mesh(device_type, shape, names)
        override = mesh_backend(device_type)
        for dims, flat in (
            (self.dp_dim_names, "dp"),
            (self.dp_shard_cp_dim_names, "dp_shard_cp"),
            (self.dp_cp_dim_names, "dp_cp"),
        ):
            if dims:
                device_mesh[dims]._flatten(flat, backend_override=override)
        return device_mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The device mesh, built on first call for `device_type`."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("You need to pass a device_type e.g cuda to build the device mesh")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device_mesh is already created with device type {self.device_mesh.device_type}, "
                f"not {device_type}."
            )
        return self.device_mesh

    def _set_size(self, parallelism: str, size: int) -> None:
        if parallelism not in self._sizes:
            raise ValueError(f"Parallelism must be one of {list(self._sizes)}")
        self._sizes[parallelism] = size
        setattr(self, f"{parallelism}_size", size)

    def _validate_accelerator(self, accelerator: Any) -> None:
        """Checks the sizes against the Accelerator's processes (a default config becomes pure replication)."""
        if not accelerator.use_distributed and self.total_size == 1:
            return
        if self.total_size == 1:
            self._set_size("dp_replicate", accelerator.num_processes)
        if self.total_size != accelerator.num_processes:
            raise ValueError(
                f"ParallelismConfig total_size ({self.total_size}) does not match num_processes "
                f"({accelerator.num_processes}). Please adjust dp_replicate_size/dp_shard_size/tp_size/"
                "cp_size/sp_size."
            )
        if accelerator.is_fsdp2 and not self.dp_shard_enabled:
            raise ValueError(
                "FSDP is enabled but the parallelism config has no dimension for FSDP to shard across "
                "(dp_shard_size is 1): give dp_shard_size > 1 (with dp_replicate_size for HSDP), or "
                "launch without FSDP to replicate"
            )


def init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """torch's `init_device_mesh`; on CPU processes whose default group shares memory (accel's backend) every
    dimension's sub-groups are accel's backend too, which serves them through shared memory where their ranks can
    share it (a mesh's sub-groups are new groups: torch would give them plain gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = mesh_backend(device_type)
    override = None if backend is None else {name: backend for name in names}
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def mesh_backend(device_type: str) -> str | None:
    """The backend of a mesh's sub-groups (see `init_mesh`): "accel" on CPU processes whose default group shares
    memory, else None (torch's choice)."""
    import torch
    import torch.distributed as dist

    if device_type != "cpu" or not dist.is_initialized():
        return None
    from accel.wire.shm_process_group import BACKEND

    cpu = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return BACKEND if cpu.name() == BACKEND else None


def refuse_unsupported_parallelism(config: ParallelismConfig, asked_by: str, sharded: bool = False) -> None:
    """Raises UnsupportedFeatureError when `config` asks for more than data parallelism: replication, and with
    `sharded` (FSDP on) sharding too."""
    for field, feature in _UNSUPPORTED_SIZES.items():
        size = getattr(config, field)
        if size > 1 and not (sharded and field == "dp_shard_size"):
            instead = SHARD_INSTEAD if field == "dp_shard_size" else DDP_INSTEAD
            raise refuse(feature, f"{asked_by} with {field}={size}", instead)


__all__ = [
    "DeepSpeedSequenceParallelConfig",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "refuse_unsupported_parallelism",
]
