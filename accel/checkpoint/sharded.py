"""Training state of sharded models in HF Accelerate's FSDP layouts: sharded (DCP folders) or full (gathered files).

`save_state` under FSDP2 with `SHARDED_STATE_DICT` (the FSDP2 default) writes, from every process, each model's
shards into `pytorch_model_fsdp_{i}/` and each optimizer's into `optimizer_{i}/` (HF's folder names, DCP's files:
`__{rank}_0.distcp` and `.metadata`), inside the same staging folder the rest of the checkpoint goes to, so a
process killed mid-save leaves the previous checkpoint. The optimizer state keeps `step`. DCP reshards on load: a
checkpoint saved by N processes loads on M, also on one process without FSDP (into plain tensors), which is how
`accel merge-weights` and a single-process resume read it.

With `FULL_STATE_DICT` (`FullStates`) every process takes part in gathering each model's and optimizer's full state
onto the main process, which writes HF's files `pytorch_model_fsdp.bin` (`_1`, ...) and `optimizer.bin` (torch.save;
the optimizer's state keyed by parameter names); loading, the main process reads them and the tensors are
broadcast and sharded into every process's part.

torch's DCP and DTensor modules are imported where they are used, not with this module: importing them costs
~6 MiB of resident memory (45 MiB with DTensor's) and ~45 ms, which every job that saves or loads a checkpoint paid,
FSDP or not (training_state imports this module).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from accel.checkpoint import shard_stager
from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.names import FSDP_MODEL_NAME, OPTIMIZER_NAME, numbered
from accel.checkpoint.safetensors_io import CheckpointError


def model_folder(index: int) -> str:
    """HF's folder of the `index`-th model's shards (numbered from 0, also the first)."""
    return f"{FSDP_MODEL_NAME}_{index}"


def optimizer_folder(index: int) -> str:
    return f"{OPTIMIZER_NAME}_{index}"


class ShardedStates:
    """Models' and optimizers' state as DCP folders (see the module docstring). Every process calls each method."""

    @staticmethod
    def present(folder: str, models: int) -> bool:
        """Whether `folder` holds the sharded state of `models` models (`pytorch_model_fsdp_{i}/`)."""
        return models > 0 and all(os.path.isdir(os.path.join(folder, model_folder(i))) for i in range(models))

    @staticmethod
    def missing(folder: str, models: int, optimizers: int) -> list[str]:
        """The folders a load of `models` models and `optimizers` optimizers needs that `folder` lacks."""
        needed = [model_folder(i) for i in range(models)] + [optimizer_folder(i) for i in range(optimizers)]
        return [name for name in needed if not os.path.isfile(os.path.join(folder, name, ".metadata"))]

    @staticmethod
    def save(
        models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], folder: str, durable: bool = False
    ) -> None:
        """Writes every model's and optimizer's DCP folder into `folder`; every process calls it. The files are
        fsynced only when `durable` (save_state's durability mode: DCP's writer fsyncs by default, which the default
        mode, complete but not flushed to disk on return, does not promise)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        for i, model in enumerate(models):
            _dcp_save({"model": get_model_state_dict(model)}, os.path.join(folder, model_folder(i)), durable)
        for i, optimizer in enumerate(optimizers):
            state = get_optimizer_state_dict(_owner(models, i, optimizer), optimizer)
            _dcp_save({"optimizer": state}, os.path.join(folder, optimizer_folder(i)), durable)

    @staticmethod
    def stage(
        models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], timeout: timedelta
    ) -> StagedShards:
        """A CPU copy of this process's shards of every model and optimizer, to be written by `StagedShards.write`
        while training goes on (see the module docstring); `timeout` bounds each of the write's collectives. Every
        process calls it at the same save (the first one makes the write's process group)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        def build() -> list[tuple[str, dict]]:
            states = [(model_folder(i), {"model": get_model_state_dict(model)}) for i, model in enumerate(models)]
            return states + [
                (optimizer_folder(i), {"optimizer": get_optimizer_state_dict(_owner(models, i, optimizer), optimizer)})
                for i, optimizer in enumerate(optimizers)
            ]

        # A plain CPU copy, made now, in the caller's thread (what dcp.async_save's default stager makes), into the
        # copy the previous save made when the state is the same (accel.checkpoint.shard_stager).
        return StagedShards(shard_stager.stager.stage(models, optimizers, build), write_group(timeout))

    @staticmethod
    def load(models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], folder: str) -> None:
        """Loads into the models and optimizers as they are (sharded or not): DCP reads each process's part."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        for i, model in enumerate(models):
            state = get_model_state_dict(model)
            dcp.load({"model": state}, storage_reader=checked_reader(os.path.join(folder, model_folder(i))))
            set_model_state_dict(model, state)
        for i, optimizer in enumerate(optimizers):
            owner = _owner(models, i, optimizer)
            state = get_optimizer_state_dict(owner, optimizer)
            dcp.load({"optimizer": state}, storage_reader=checked_reader(os.path.join(folder, optimizer_folder(i))))
            set_optimizer_state_dict(owner, optimizer, state)


@dataclasses.dataclass
class StagedShards:
    """Sharded state copied by `ShardedStates.stage`: {DCP folder name: state}, and the group that writes it."""

    states: list[tuple[str, dict]]
    group: dist.ProcessGroup | None  # None: one process, without a process group

    def write(self, folder: str) -> None:
        """Writes every DCP folder into `folder`. Every process calls it, in its checkpoint worker; it returns once
        every process's part of every folder is written (or raises on every process if one failed)."""
        for name, state in self.states:  # durable: an asynchronous save is published durable
            _dcp_save(state, os.path.join(folder, name), durable=True, group=self.group)


_write_group_of: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (the default group, its gloo group)


def write_group(timeout: timedelta) -> dist.ProcessGroup | None:
    """The gloo group that asynchronous saves exchange and write sharded state through on the checkpoint worker
    (training's collectives run on the default group meanwhile), made once per default process group with
    `timeout` (a collective on it: every process asks at the same save); None without a process group."""
    global _write_group_of
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _write_group_of is None or _write_group_of[0] is not default:  # first save, or a new default group
        _write_group_of = (default, dist.new_group(backend="gloo", timeout=timeout))
    return _write_group_of[1]


class FullStates:
    """Models' and optimizers' full state in HF's FSDP FULL_STATE_DICT files (see the module docstring). Every
    process calls each method; the main process reads and writes the files."""

    @staticmethod
    def present(folder: str, models: int) -> bool:
        return models > 0 and all(os.path.isfile(os.path.join(folder, _model_file(i))) for i in range(models))

    @staticmethod
    def missing(folder: str, models: int, optimizers: int) -> list[str]:
        needed = [_model_file(i) for i in range(models)] + [_optimizer_file(i) for i in range(optimizers)]
        return [name for name in needed if not os.path.isfile(os.path.join(folder, name))]

    @staticmethod
    def save(
        models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], folder: str, durable: bool = False
    ) -> None:
        for name, state in FullStates.gather(models, optimizers).items():
            write_atomically(os.path.join(folder, name), lambda f, state=state: torch.save(state, f), durable=durable)

    @staticmethod
    def gather(models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, dict]:
        """{file name: full state} on the main process ({} on the others), gathered from every process's shards
        into CPU memory: what `save` writes, and what an asynchronous save hands to its worker to write."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered onto the main process
        states = {_model_file(i): get_model_state_dict(model, options=options) for i, model in enumerate(models)}
        states.update(
            {
                _optimizer_file(i): get_optimizer_state_dict(_owner(models, i, optimizer), optimizer, options=options)
                for i, optimizer in enumerate(optimizers)
            }
        )
        return states if _is_main() else {}

    @staticmethod
    def load(models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], folder: str) -> None:
        """Sharded models get the main process's reading, broadcast; others read the files themselves."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        for i, model in enumerate(models):
            sharded = _is_sharded(model)
            state = _read(os.path.join(folder, _model_file(i))) if _is_main() or not sharded else {}
            set_model_state_dict(model, state, options=_full_options(sharded))
        for i, optimizer in enumerate(optimizers):
            owner = _owner(models, i, optimizer)
            sharded = _is_sharded(owner)
            state = _read(os.path.join(folder, _optimizer_file(i))) if _is_main() or not sharded else {}
            set_optimizer_state_dict(owner, optimizer, state, options=_full_options(sharded))


def checked_reader(path: str) -> Any:
    """torch DCP's `FileSystemReader` for the folder `path`, reading its `.metadata` without running anything a
    crafted file names: torch's reader unpickles it with `pickle.load` (any callable in it runs), this one builds
    only DCP's metadata types, torch.Size, dtypes and paths, and it refuses shard files named outside the folder
    (`../x`, `/abs`). The metadata is read and checked here, so a bad folder is a CheckpointError naming the file
    (inside DCP's load it would come wrapped in DCP's own exception). Loads of sharded checkpoints and `accel
    merge-weights` read through it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = _checked_metadata(os.path.join(path, ".metadata"))

    class CheckedReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(path)


def _checked_metadata(metadata_path: str) -> Any:
    with open(metadata_path, "rb") as file:
        metadata = _MetadataUnpickler(file, metadata_path).load()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        name = str(getattr(info, "relative_path", ""))
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointError(
                f"{metadata_path}: the shard file of {getattr(index, 'fqn', index)!r} is "
                f"{name!r}, not a file of its folder"
            )
    return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's `.metadata` holds (see `checked_reader`); anything else is a CheckpointError."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def __init__(self, file: Any, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise CheckpointError(
                f"{self._path}: DCP metadata names {module}.{name}, which is not one of DCP's "
                "metadata types: refused (a crafted file would run it)"
            )
        return found

    def _allowed(self, module: str, name: str) -> bool:
        if (module, name) in self._ALLOWED:
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), torch.dtype)
        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as dcp_metadata

            return isinstance(getattr(dcp_metadata, name, None), type)
        return False


class ShardedWriteError(RuntimeError):
    """A DCP folder could not be written; the message names it and what failed on which process."""


def _dcp_save(state: dict, path: str, durable: bool, group: dist.ProcessGroup | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=durable), process_group=group)
    except CheckpointException as error:
        # DCP's exception is a BaseException: `except Exception` (the save's agreement on a failure, users' code)
        # would let it past, and a failed synchronous save would leave its staging folder behind.
        raise ShardedWriteError(f"writing the sharded checkpoint {path} failed: {error}") from error


def _model_file(index: int) -> str:
    return numbered(FSDP_MODEL_NAME, index, ".bin")


def _optimizer_file(index: int) -> str:
    return numbered(OPTIMIZER_NAME, index, ".bin")


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _full_options(sharded: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded and dist.is_initialized())


def _read(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _owner(models: list[torch.nn.Module], index: int, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """The model whose parameters `optimizer` trains (HF pairs them by index; else the first that holds them)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    candidates = ([models[index]] if index < len(models) else []) + models
    for model in candidates:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ValueError(f"optimizer {index} trains none of the prepared models' parameters")
