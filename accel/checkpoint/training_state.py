"""save_state / load_state: a training run's whole state in HF Accelerate's folder layout, written atomically.

Files (HF's names, so its users find what they expect):
  model.safetensors, model_1.safetensors, ...   each prepared model's state dict (pytorch_model*.bin without
                                                safe_serialization); keys as the model given to prepare names
                                                them, as HF writes them (no "module." / "_orig_mod." of the
                                                DDP / compile wrappers); loading also accepts those prefixes
  optimizer.bin, optimizer_1.bin, ...           optimizer state dicts (torch.save)
  scheduler.bin, ...                            scheduler state dicts
  sampler.bin, ...                              each prepared dataloader's epoch and seedable-sampler seed
  dl_state_dict.bin, dl_state_dict_1.bin, ...   each stateful prepared dataloader's state_dict() (its position)
  scaler.pt                                     the fp16 gradient scaler
  random_states_{rank}.pkl                      every process's python / numpy / torch (/ CUDA) RNG states and step
  custom_checkpoint_{i}.pkl                     register_for_checkpointing objects' state dicts

What HF gets wrong and accel does not:
  - the checkpoint is written into a hidden `.NAME.partial` folder next to its final place and renamed there only
    once every process's files are in it (an existing folder of that name is swapped out atomically with
    renameat2(RENAME_EXCHANGE)), so a crash mid-save leaves the previous checkpoint intact and never a partial
    one that load_state would pick (staging, publishing, rotation: accel.checkpoint.publish);
  - saves come in three modes (accel.checkpoint.background): by default the call returns once the files are
    complete and published from the page cache, as fast as HF's save, and durability (fsync, then the record
    `.accel-durability` rewritten to say so) follows in the background without changing any directory entry;
    `durable_save` waits for it; `async_save` returns after an in-memory snapshot and writes in the background;
  - a replaced or rotated-out checkpoint is gone before the call returns (its blocks are freed in the background:
    that is the slow part of a removal);
  - with automatic_checkpoint_naming, old checkpoints are rotated out by checkpoint number (not string order),
    after the new one is in place; the newest durable one stays until the new one is durable too, and is removed
    at the next call that joins the background (the next save, load_state, wait_for_checkpoint, end_training, or
    the interpreter's exit): with total_limit=N, N+1 checkpoints may exist until then. `load_state()` loads the
    latest durable one (see latest_checkpoint) and sets the iteration so the next save gets the next number;
  - nothing is unpickled beyond weights_only=True (numpy's RNG arrays are allowlisted for the RNG files); pass
    `load_kwargs={"weights_only": False}` for custom objects whose state dicts hold arbitrary Python objects;
  - a failure on one process (a full disk, a hook raising) raises on every process, and nothing is published.
Two cases give up atomicity rather than data: a folder that holds other things than a checkpoint (logs...) gets
its checkpoint files replaced one by one, and a folder that cannot be staged beside (a mount point, a read-only
parent) is written in place. save_state is collective: every process must call it.

What is saved comes from the Accelerator through one seam, `Accelerator.checkpointable()` (a `Checkpointable`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from accel import collectives
from accel.checkpoint import background, snapshot
from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.background import SaveMode, durability_of, make_durable
from accel.checkpoint.model_io import without_shared_tensors
from accel.checkpoint.names import (
    CUSTOM_CHECKPOINT_NAME,
    DATALOADER_STATE_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    custom_checkpoint_name,
    numbered,
)
from accel.checkpoint.publish import (
    can_stage_beside,
    checkpoint_number,
    numbered_checkpoints,
    partial_name,
    prepare_staging,
    publish_and_rotate,
    recover_interrupted_publish,
)
from accel.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_file
from accel.data import get_sampler
from accel.environment import get_cpu_distributed_information

logger = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclasses.dataclass(frozen=True)
class Checkpointable:
    """What save_state and load_state cover, as `Accelerator.checkpointable()` hands it over.

    The lists are the Accelerator's own (what it prepared, in preparation order; a hook may pop from `models`'
    copies only). `step` is the Accelerator's at the time of the call; load_state returns the loaded one.
    """

    models: list[torch.nn.Module]  # as given to prepare (without DDP / compile wrappers: HF saves these names)
    optimizers: list
    schedulers: list
    dataloaders: list
    custom_objects: list  # register_for_checkpointing's
    scaler: Any  # the fp16 GradScaler, or None
    state_dict: Callable[[torch.nn.Module], dict]  # what is saved of a prepared model
    project_configuration: Any  # a ProjectConfiguration: its iteration advances with each save
    project_dir: str | None
    writes_shared_files: bool  # this process writes the files one process writes for all (main, or each node's)
    process_index: int
    num_processes: int
    device: torch.device
    step: int


# --- saving ------------------------------------------------------------------------------------------------------


def save_state(parts: Checkpointable, output_dir: str | None, safe_serialization: bool,
               pre_hooks: list[Callable], mode: SaveMode = SaveMode(durable=True)) -> str:  # fmt: skip
    """Writes the state of everything in `parts` into `output_dir` (see the module docstring), in one of the three
    save modes of accel.checkpoint.background.

    Every process calls it (it synchronizes them three times: the staging folder exists, every file is in place,
    the checkpoint is published); a failure on any process raises on all of them and publishes nothing. With
    `mode.asynchronous`, the saving process snapshots its files' contents and writes and publishes them in the
    background; the others return once their own files are written.
    """
    config = parts.project_configuration
    root, output_dir = _target(parts, output_dir)
    # A process that names another folder than the main process's (each its own temporary folder, as HF's tests
    # do) writes a whole checkpoint there, so that its load_state finds one (and its staging folder is published).
    own_folder = not _same_folder_as_main(parts, output_dir)  # a collective: every process calls it
    writes_shared_files = parts.writes_shared_files or own_folder
    node = _node_index(parts) if config.save_on_each_node else None
    staged = can_stage_beside(output_dir)
    staging = partial_name(output_dir, node) if staged else output_dir
    if not staged and writes_shared_files:
        logger.warning("cannot stage '%s' next to it (parent not writable, or a mount point): writing in place, "
                       "not atomically", output_dir)  # fmt: skip
    failure = None
    try:
        background.saves.join(asynchronous_only=True)  # an earlier asynchronous save is published (or raises) first
        if writes_shared_files:
            prepare_staging(output_dir, staging, staged)
    except Exception as error:  # noqa: BLE001 - reported on every process below
        failure = error
    _agree_or_raise(parts, failure, "preparing")  # the staging folder exists for every process

    files: dict[str, Any] = {}
    try:
        os.makedirs(staging, exist_ok=True)  # processes on other nodes' disks
        weights = [parts.state_dict(model) for model in parts.models]
        for hook in pre_hooks:  # (models, weights, folder): a hook may pop what it saves itself, HF-style
            hook(list(parts.models), weights, staging)
        if writes_shared_files:
            files = shared_files(parts, weights, safe_serialization)
            if not mode.asynchronous:
                write_files(staging, files, durable=mode.durable)
        save_rng_state(staging, parts.process_index, parts.step, durable=mode.durable)
    except Exception as error:  # noqa: BLE001
        failure = error
    _agree_or_raise(parts, failure, "writing", cleanup=staging if staged and writes_shared_files else None)

    try:
        if writes_shared_files:
            # An asynchronous save is published durable (by the worker): its caller does not wait for the fsync.
            finish = functools.partial(publish_and_rotate, staging if staged else None, output_dir, root,
                                       config.total_limit, mode.durable or mode.asynchronous)  # fmt: skip
            if mode.asynchronous:
                snapshot_of_files = snapshot.buffers.take(files)
                background.saves.submit(lambda: (write_files(staging, snapshot_of_files, durable=False), finish()),
                                        f"save_state into '{output_dir}'", asynchronous=True)  # fmt: skip
            else:
                finish()
    except Exception as error:  # noqa: BLE001
        failure = error
    _agree_or_raise(parts, failure, "publishing")  # nobody returns before the checkpoint is visible
    config.iteration += 1
    return output_dir


def _node_index(parts: Checkpointable) -> int:
    """Which machine this process is on (processes are numbered node by node, as torchrun does)."""
    return parts.process_index // max(1, get_cpu_distributed_information().local_world_size)


def _target(parts: Checkpointable, output_dir: str | None) -> tuple[str | None, str]:
    """(the checkpoints root with automatic naming, else None; the folder to save into)."""
    config = parts.project_configuration
    if config.automatic_checkpoint_naming:
        if parts.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs a project_dir (ProjectConfiguration(project_dir=...))")
        if config.total_limit is not None and config.total_limit < 1:
            raise ValueError(f"total_limit must be at least 1, got {config.total_limit}")
        root = os.path.join(parts.project_dir, "checkpoints")
        output_dir = os.path.join(root, f"checkpoint_{config.iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"checkpoint folder '{output_dir}' (iteration {config.iteration}) already exists; set "
                             "accelerator.project_configuration.iteration to the number to continue from")  # fmt: skip
        return root, output_dir
    if output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    output_dir = os.path.realpath(os.path.expanduser(os.fspath(output_dir)))  # a symlinked folder: stage by the target
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"save_state: '{output_dir}' exists and is not a folder")
    return None, output_dir


def _same_folder_as_main(parts: Checkpointable, output_dir: str) -> bool:
    """Whether the main process saves into `output_dir` too (one broadcast of its path)."""
    if parts.num_processes == 1:
        return True
    return collectives.broadcast_object_list([output_dir])[0] == output_dir


def _agree_or_raise(parts: Checkpointable, failure: BaseException | None, stage: str, cleanup: str | None = None
                    ) -> None:  # fmt: skip
    """A barrier that also tells every process whether any failed, so all raise instead of some waiting forever."""
    failed = failure is not None
    if parts.num_processes > 1:
        flag = torch.tensor([1 if failed else 0], device=parts.device)
        failed = bool(collectives.reduce(flag, reduction="sum").item())
    if not failed:
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if failure is not None:
        raise failure
    raise RuntimeError(f"save_state failed on another process while {stage}; nothing was published")


def shared_files(parts: Checkpointable, weights: list[dict], safe_serialization: bool) -> dict[str, Any]:
    """{file name: what goes in it} for the files one process writes for all: weights (a state dict per model,
    `.safetensors` or `.bin`), optimizers, schedulers, dataloaders, scaler, registered objects. The objects'
    state dicts are taken now; an asynchronous save copies them before it returns."""
    files: dict[str, Any] = {}
    for i, state_dict in enumerate(weights):
        if safe_serialization:
            files[numbered(SAFE_MODEL_NAME, i, ".safetensors")] = without_shared_tensors(state_dict)
        else:
            files[numbered(MODEL_NAME, i, ".bin")] = state_dict
    for i, optimizer in enumerate(parts.optimizers):
        files[numbered(OPTIMIZER_NAME, i, ".bin")] = optimizer.state_dict()
    for i, scheduler in enumerate(parts.schedulers):
        files[numbered(SCHEDULER_NAME, i, ".bin")] = scheduler.state_dict()
    for i, loader in enumerate(parts.dataloaders):
        files[numbered(SAMPLER_NAME, i, ".bin")] = loader_state(loader)
        if getattr(loader, "use_stateful_dataloader", False):
            files[numbered(DATALOADER_STATE_NAME, i, ".bin")] = loader.state_dict()
    if parts.scaler is not None:
        files[SCALER_NAME] = parts.scaler.state_dict()
    for i, obj in enumerate(parts.custom_objects):
        files[custom_checkpoint_name(i)] = obj.state_dict()
    return files


def write_files(folder: str, files: dict[str, Any], durable: bool) -> None:
    """Writes `files` (see shared_files) into `folder`: safetensors for `.safetensors` names, torch.save for the
    rest; fsync'd when `durable` (the folder is renamed into place only after)."""
    for name, content in files.items():
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            save_file(content, path, metadata={"format": "pt"}, durable=durable)
        else:
            write_atomically(path, lambda f, content=content: torch.save(content, f), durable=durable)


def loader_state(loader: Any) -> dict:
    """What a prepared dataloader needs to replay its next epoch: its epoch count and its sampler's seed."""
    sampler = get_sampler(loader)
    return {"iteration": getattr(loader, "iteration", 0), "initial_seed": getattr(sampler, "initial_seed", None)}


def save_rng_state(folder: str, process_index: int, step: int, durable: bool = True) -> None:
    """Writes this process's python / numpy / torch (/ CUDA) RNG states and `step` to
    `folder/random_states_{process_index}.pkl` (fsync'd when `durable`)."""
    states = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    path = os.path.join(folder, f"{RNG_STATE_NAME}_{process_index}.pkl")
    write_atomically(path, lambda f: torch.save(states, f), durable=durable)


# --- loading -----------------------------------------------------------------------------------------------------


def latest_checkpoint(project_dir: str | None) -> str:
    """The newest `checkpoints/checkpoint_N` that is durable (or unmarked: HF's, an older accel's). One published
    without fsync during this boot is made durable now (its bytes are in the page cache); one published without
    fsync before the machine restarted is passed over for an older durable one (its bytes may be lost)."""
    root = os.path.join(project_dir or ".", "checkpoints")
    folders = numbered_checkpoints(root)
    if not folders:
        raise FileNotFoundError(f"no checkpoint_N folder in '{root}' to load")
    for folder in reversed(folders):
        state = durability_of(folder)
        if state == "this-boot":
            make_durable(folder)
        if state != "lost-boot":
            if folder != folders[-1]:
                logger.warning("loading '%s': the newer checkpoints were saved without fsync before this machine "
                               "restarted, so their files may be incomplete", folder)  # fmt: skip
            return folder
    logger.warning("every checkpoint in '%s' was saved without fsync before this machine restarted; loading the "
                   "newest, '%s', whose files may be incomplete", root, folders[-1])  # fmt: skip
    return folders[-1]


def load_state(parts: Checkpointable, input_dir: str | None, load_kwargs: dict | None, pre_hooks: list[Callable],
               strict: bool = True) -> tuple[str, int | None]:  # fmt: skip
    """Restores everything in `parts` from `input_dir` (default: the latest numbered checkpoint); returns the folder
    and the step saved with this process's RNG states (None when it has none: the step stays as it is).

    Every file it needs is checked to be there before anything is restored, so a wrong folder changes nothing.
    """
    config = parts.project_configuration
    background.saves.join(asynchronous_only=True)  # this process's asynchronous save is published first
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError("load_state needs input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
        input_dir = latest_checkpoint(parts.project_dir)
    input_dir = os.path.expanduser(os.fspath(input_dir))
    recover_interrupted_publish(input_dir)
    if not os.path.isdir(input_dir):
        raise ValueError(f"checkpoint folder '{input_dir}' does not exist")
    if durability_of(input_dir) == "lost-boot":
        logger.warning("'%s' was saved without fsync before this machine restarted: its files may be incomplete",
                       input_dir)  # fmt: skip
    load_kwargs = {"weights_only": True, **(load_kwargs or {})}
    models = list(parts.models)  # a hook may pop the models it loads itself (HF's diffusers pattern)
    for hook in pre_hooks:
        hook(models, input_dir)
    _check_complete(parts, models, input_dir)
    for i, model in enumerate(models):
        load_model_weights(model, input_dir, i, strict)
    for i, optimizer in enumerate(parts.optimizers):
        optimizer.load_state_dict(_load(os.path.join(input_dir, numbered(OPTIMIZER_NAME, i, ".bin")), load_kwargs))
    for i, scheduler in enumerate(parts.schedulers):
        scheduler.load_state_dict(_load(os.path.join(input_dir, numbered(SCHEDULER_NAME, i, ".bin")), load_kwargs))
    for i, loader in enumerate(parts.dataloaders):
        restore_loader_files(loader, input_dir, i, load_kwargs)
    if parts.scaler is not None and os.path.exists(os.path.join(input_dir, SCALER_NAME)):
        parts.scaler.load_state_dict(_load(os.path.join(input_dir, SCALER_NAME), load_kwargs))
    _load_custom_objects(parts.custom_objects, input_dir, load_kwargs)
    step = load_rng_state(input_dir, parts.process_index)
    number = checkpoint_number(input_dir)
    if config.automatic_checkpoint_naming and number is not None:
        config.iteration = number + 1  # the next save_state continues the numbering
    return input_dir, step


def _check_complete(parts: Checkpointable, models: list, folder: str) -> None:
    """Raises, naming what is missing, unless `folder` holds a file for everything that will be restored."""
    missing = []
    for i in range(len(models)):
        if not any(os.path.exists(os.path.join(folder, numbered(name, i, ext)))
                   for name, ext in ((SAFE_MODEL_NAME, ".safetensors"), (MODEL_NAME, ".bin"))):  # fmt: skip
            missing.append(numbered(SAFE_MODEL_NAME, i, ".safetensors"))
    missing += [numbered(OPTIMIZER_NAME, i, ".bin") for i in range(len(parts.optimizers))]
    missing += [numbered(SCHEDULER_NAME, i, ".bin") for i in range(len(parts.schedulers))]
    missing = [name for name in missing if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(f"'{folder}' is not a complete checkpoint for what was prepared: missing "
                                f"{', '.join(missing)}")  # fmt: skip
    found = [f for f in os.listdir(folder) if re.fullmatch(rf"{CUSTOM_CHECKPOINT_NAME}_\d+\.pkl", f)]
    if len(found) != len(parts.custom_objects):
        raise RuntimeError(f"'{folder}' holds {len(found)} custom checkpoints but {len(parts.custom_objects)} "
                           "objects are registered (register_for_checkpointing): load a checkpoint saved with the "
                           "same registrations")  # fmt: skip


def _load(path: str, load_kwargs: dict) -> Any:
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file '{path}' is missing")
    return torch.load(path, map_location="cpu", **load_kwargs)


def _strip_wrappers(names: list[str]) -> dict[str, str]:
    """{name without the wrappers' prefix: name}: DDP's "module." / torch.compile's "_orig_mod." are removed only
    when every name carries it (a model may have a submodule called `module` of its own)."""
    mapping = {name: name for name in names}
    changed = True
    while changed and mapping:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in mapping):
                mapping = {key[len(prefix):]: name for key, name in mapping.items()}
                changed = True
    return mapping


def load_model_weights(model: torch.nn.Module, folder: str, index: int, strict: bool) -> None:
    """Loads `model_{index}.safetensors` (else `pytorch_model_{index}.bin`) of `folder` into `model`, with or without
    the DDP / torch.compile prefixes on either side; `strict`: every name must match."""
    own = model.state_dict(keep_vars=True)
    targets = {key: own[name] for key, name in _strip_wrappers(list(own)).items()}
    safe = os.path.join(folder, numbered(SAFE_MODEL_NAME, index, ".safetensors"))
    if os.path.exists(safe):
        with SafetensorsFile(safe) as f:  # validated and read through one descriptor
            names = _strip_wrappers(list(f.header.tensors))
            _check_names(safe, set(names), targets, strict)
            f.read_into({names[key]: tensor.data for key, tensor in targets.items() if key in names})
        return
    path = os.path.join(folder, numbered(MODEL_NAME, index, ".bin"))
    loaded = _load(path, {"weights_only": True})
    state_dict = {key: loaded[name] for key, name in _strip_wrappers(list(loaded)).items()}
    _check_names(path, set(state_dict), targets, strict)
    for key, tensor in state_dict.items():
        if key in targets and targets[key].shape != tensor.shape:
            raise CheckpointError(f"'{path}', tensor '{key}': the checkpoint has shape {list(tensor.shape)}, "
                                  f"the model {list(targets[key].shape)}")  # fmt: skip
    with torch.no_grad():
        for key, tensor in state_dict.items():
            if key in targets:
                targets[key].data.copy_(tensor)


def _check_names(path: str, saved: set[str], targets: dict[str, torch.Tensor], strict: bool) -> None:
    # Tied weights are saved once: a missing name is fine when a saved one shares its memory.
    saved_memory = {targets[k].data_ptr() for k in saved if k in targets and targets[k].numel()}
    missing = [k for k in targets if k not in saved and not (targets[k].numel() and targets[k].data_ptr() in saved_memory)]
    unexpected = sorted(saved - set(targets))
    if strict and (missing or unexpected):
        raise CheckpointError(f"'{path}' does not fit the model: missing {missing or 'nothing'}, "
                              f"unexpected {unexpected or 'nothing'}")  # fmt: skip


def restore_loader_files(loader: Any, folder: str, index: int, load_kwargs: dict) -> None:
    """Restores the `index`-th prepared dataloader from `folder`: its epoch and sampler seed (`sampler*.bin`), then
    a stateful loader's position (`dl_state_dict*.bin`). A missing file leaves that part as it is (HF does so)."""
    path = os.path.join(folder, numbered(SAMPLER_NAME, index, ".bin"))
    if os.path.exists(path):
        restore_loader(loader, _load(path, load_kwargs))
    path = os.path.join(folder, numbered(DATALOADER_STATE_NAME, index, ".bin"))
    if getattr(loader, "use_stateful_dataloader", False) and os.path.exists(path):
        loader.load_state_dict(_load(path, load_kwargs))


def restore_loader(loader: Any, state: dict) -> None:
    """Gives a prepared dataloader back the epoch and sampler seed `loader_state` recorded."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(state.get("iteration", 0))
    sampler = get_sampler(loader)
    if state.get("initial_seed") is not None and hasattr(sampler, "initial_seed"):
        sampler.initial_seed = state["initial_seed"]


def _load_custom_objects(objects: list, folder: str, load_kwargs: dict) -> None:
    for i, obj in enumerate(objects):
        obj.load_state_dict(_load(os.path.join(folder, custom_checkpoint_name(i)), load_kwargs))


def _numpy_rng_globals() -> list:
    """What unpickling numpy's RNG state needs, under both module paths numpy 1 and 2 pickle it with."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"),
            (reconstruct, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rng_state(folder: str, process_index: int) -> int | None:
    """Restores the RNG states `save_rng_state` wrote for `process_index`; returns the step saved with them (None
    when the file is missing)."""
    path = os.path.join(folder, f"{RNG_STATE_NAME}_{process_index}.pkl")
    if not os.path.exists(path):
        logger.info("no random states for process %d in '%s'", process_index, folder)
        return None
    with torch.serialization.safe_globals(_numpy_rng_globals()):  # numpy's RNG state is an array
        states = torch.load(path, weights_only=True)
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    return states.get("step")
