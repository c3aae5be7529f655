"""save_state / load_state: a training run's whole state in HF Accelerate's folder layout, written atomically.

Files (HF's names, so its users find what they expect):
  model.safetensors, model_1.safetensors, ...   each prepared model's state dict (pytorch_model*.bin without
                                                safe_serialization); keys as the prepared model names them,
                                                as HF does ("module." under DDP); loading accepts either form
  optimizer.bin, optimizer_1.bin, ...           optimizer state dicts (torch.save)
  scheduler.bin, ...                            scheduler state dicts
  sampler.bin, ...                              each prepared dataloader's epoch and seedable-sampler seed
  scaler.pt                                     the fp16 gradient scaler
  random_states_{rank}.pkl                      every process's python / numpy / torch (/ CUDA) RNG states and step
  custom_checkpoint_{i}.pkl                     register_for_checkpointing objects' state dicts

What HF gets wrong and accel does not:
  - the checkpoint is written into a hidden `.NAME.partial` folder next to its final place and renamed there only
    once every process's files are in it (an existing folder of that name is swapped out atomically with
    renameat2(RENAME_EXCHANGE)), so a crash mid-save leaves the previous checkpoint intact and never a partial
    one that load_state would pick;
  - with automatic_checkpoint_naming, old checkpoints are rotated out by checkpoint number (not string order),
    after the new one is in place; `load_state()` loads the latest and sets the iteration so the next save gets
    the next number;
  - nothing is unpickled beyond weights_only=True (numpy's RNG arrays are allowlisted for the RNG files); pass
    `load_kwargs={"weights_only": False}` for custom objects whose state dicts hold arbitrary Python objects.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from accel.checkpoint.model_io import without_shared_tensors
from accel.checkpoint.safetensors_io import CheckpointError, fsync_directory, read_header, read_into, save_file

logger = logging.getLogger(__name__)

SAFE_MODEL_NAME, MODEL_NAME = "model", "pytorch_model"
OPTIMIZER_NAME, SCHEDULER_NAME, SAMPLER_NAME = "optimizer", "scheduler", "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
CHECKPOINT_PATTERN = re.compile(r"checkpoint_(\d+)")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def numbered(name: str, index: int, extension: str) -> str:
    """HF's numbering: `optimizer.bin`, `optimizer_1.bin`, ..."""
    return f"{name}{'' if index == 0 else f'_{index}'}{extension}"


# --- where checkpoints go ----------------------------------------------------------------------------------------


def checkpoint_number(folder: str) -> int | None:
    match = CHECKPOINT_PATTERN.fullmatch(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else None


def numbered_checkpoints(root: str) -> list[str]:
    """The `checkpoint_N` folders under `root`, oldest (lowest N) first; anything else there is ignored."""
    if not os.path.isdir(root):
        return []
    folders = [os.path.join(root, name) for name in os.listdir(root) if checkpoint_number(name) is not None]
    return sorted((f for f in folders if os.path.isdir(f)), key=checkpoint_number)


def partial_name(final: str) -> str:
    folder, name = os.path.split(os.path.normpath(final))
    return os.path.join(folder, f".{name}.partial")


def publish(partial: str, final: str) -> None:
    """Moves the complete `partial` folder to `final`; an existing `final` is swapped out in one step."""
    if not os.path.exists(final):
        os.rename(partial, final)
    elif _exchange(partial, final):
        shutil.rmtree(partial)  # now the previous checkpoint
    else:  # no renameat2 here: two renames, with the old folder kept until the new one is in place
        old = partial + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old)
    fsync_directory(os.path.dirname(os.path.normpath(final)) or ".")


def _exchange(a: str, b: str) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE): atomically swaps two paths; False where the system cannot."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if function(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap '{a}' and '{b}': {os.strerror(code)}")


# --- saving ------------------------------------------------------------------------------------------------------


def save_state(accelerator: Any, output_dir: str | None, safe_serialization: bool,
               pre_hooks: list[Callable]) -> str:  # fmt: skip
    """Writes the state of everything `accelerator` prepared into `output_dir` (see the module docstring)."""
    config = accelerator.project_configuration
    root = None
    if config.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        output_dir = os.path.join(root, f"checkpoint_{config.iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"checkpoint folder '{output_dir}' (iteration {config.iteration}) already exists; set "
                             "accelerator.project_configuration.iteration to the number to continue from")  # fmt: skip
    elif output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    output_dir = os.path.expanduser(os.fspath(output_dir))
    partial = partial_name(output_dir)
    writes_shared_files = accelerator._saves_here()
    if writes_shared_files:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crashed save
        os.makedirs(partial)
    accelerator.wait_for_everyone()  # the folder exists for every process

    weights = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
    for hook in pre_hooks:
        hook(accelerator._models, weights, output_dir)
    if writes_shared_files:
        _save_shared_files(accelerator, partial, weights, safe_serialization)
    _save_rng_state(partial, accelerator.process_index, accelerator.step)
    accelerator.wait_for_everyone()  # every process's files are in place

    if writes_shared_files:
        publish(partial, output_dir)
        if root is not None and config.total_limit is not None:
            for old in numbered_checkpoints(root)[: -config.total_limit]:
                logger.warning("removing checkpoint '%s' (total_limit=%d)", old, config.total_limit)
                shutil.rmtree(old)
    config.iteration += 1
    accelerator.wait_for_everyone()  # nobody returns before the checkpoint is visible
    return output_dir


def _save_shared_files(accelerator: Any, folder: str, weights: list[dict], safe_serialization: bool) -> None:
    for i, state_dict in enumerate(weights):
        if safe_serialization:
            save_file(without_shared_tensors(state_dict), os.path.join(folder, numbered(SAFE_MODEL_NAME, i, ".safetensors")),
                      metadata={"format": "pt"})  # fmt: skip
        else:
            torch.save(state_dict, os.path.join(folder, numbered(MODEL_NAME, i, ".bin")))
    for i, optimizer in enumerate(accelerator._optimizers):
        torch.save(optimizer.state_dict(), os.path.join(folder, numbered(OPTIMIZER_NAME, i, ".bin")))
    for i, scheduler in enumerate(accelerator._schedulers):
        torch.save(scheduler.state_dict(), os.path.join(folder, numbered(SCHEDULER_NAME, i, ".bin")))
    for i, loader in enumerate(accelerator._dataloaders):
        torch.save(_loader_state(loader), os.path.join(folder, numbered(SAMPLER_NAME, i, ".bin")))
    if accelerator.scaler is not None:
        torch.save(accelerator.scaler.state_dict(), os.path.join(folder, SCALER_NAME))
    for i, obj in enumerate(accelerator._custom_objects):
        torch.save(obj.state_dict(), os.path.join(folder, f"custom_checkpoint_{i}.pkl"))
    for name in os.listdir(folder):  # the data is on disk before the folder is renamed into place
        _fsync_file(os.path.join(folder, name))


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _loader_state(loader: Any) -> dict:
    """What a prepared dataloader needs to replay its next epoch: its epoch count and its sampler's seed."""
    from accel.data.loaders import get_sampler

    sampler = get_sampler(loader)
    return {"iteration": getattr(loader, "iteration", 0), "initial_seed": getattr(sampler, "initial_seed", None)}


def _save_rng_state(folder: str, process_index: int, step: int) -> None:
    states = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    path = os.path.join(folder, f"{RNG_STATE_NAME}_{process_index}.pkl")
    torch.save(states, path)
    _fsync_file(path)


# --- loading -----------------------------------------------------------------------------------------------------


def latest_checkpoint(accelerator: Any) -> str:
    root = os.path.join(accelerator.project_dir or ".", "checkpoints")
    folders = numbered_checkpoints(root)
    if not folders:
        raise FileNotFoundError(f"no checkpoint_N folder in '{root}' to load")
    return folders[-1]


def load_state(accelerator: Any, input_dir: str | None, load_kwargs: dict | None, pre_hooks: list[Callable],
               strict: bool = True) -> str:  # fmt: skip
    """Restores everything `accelerator` prepared from `input_dir` (default: the latest numbered checkpoint)."""
    config = accelerator.project_configuration
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError("load_state needs input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
        input_dir = latest_checkpoint(accelerator)
    input_dir = os.path.expanduser(os.fspath(input_dir))
    if not os.path.isdir(input_dir):
        raise ValueError(f"checkpoint folder '{input_dir}' does not exist")
    load_kwargs = {"weights_only": True, **(load_kwargs or {})}
    for hook in pre_hooks:
        hook(accelerator._models, input_dir)
    for i, model in enumerate(accelerator._models):
        _load_model(model, input_dir, i, strict)
    for i, optimizer in enumerate(accelerator._optimizers):
        optimizer.load_state_dict(_load(os.path.join(input_dir, numbered(OPTIMIZER_NAME, i, ".bin")), load_kwargs))
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(_load(os.path.join(input_dir, numbered(SCHEDULER_NAME, i, ".bin")), load_kwargs))
    for i, loader in enumerate(accelerator._dataloaders):
        path = os.path.join(input_dir, numbered(SAMPLER_NAME, i, ".bin"))
        if os.path.exists(path):
            _restore_loader(loader, _load(path, load_kwargs))
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(_load(os.path.join(input_dir, SCALER_NAME), load_kwargs))
    _load_custom_objects(accelerator._custom_objects, input_dir, load_kwargs)
    step = _load_rng_state(input_dir, accelerator.process_index)
    if step is not None:
        accelerator.step = step
    number = checkpoint_number(input_dir)
    if config.automatic_checkpoint_naming and number is not None:
        config.iteration = number + 1  # the next save_state continues the numbering
    return input_dir


def _load(path: str, load_kwargs: dict) -> Any:
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file '{path}' is missing")
    return torch.load(path, map_location="cpu", **load_kwargs)


def _normalized(name: str) -> str:
    """A state-dict key without the wrappers' prefixes (DDP's "module.", torch.compile's "_orig_mod.")."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _load_model(model: torch.nn.Module, folder: str, index: int, strict: bool) -> None:
    targets = {_normalized(name): tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    safe = os.path.join(folder, numbered(SAFE_MODEL_NAME, index, ".safetensors"))
    if os.path.exists(safe):
        header = read_header(safe)
        names = {_normalized(name): name for name in header.tensors}
        _check_names(safe, set(names), targets, strict)
        read_into(header, {names[key]: tensor.data for key, tensor in targets.items() if key in names})
        return
    path = os.path.join(folder, numbered(MODEL_NAME, index, ".bin"))
    state_dict = {_normalized(k): v for k, v in _load(path, {"weights_only": True}).items()}
    _check_names(path, set(state_dict), targets, strict)
    with torch.no_grad():
        for key, tensor in state_dict.items():
            if key in targets:
                if targets[key].shape != tensor.shape:
                    raise CheckpointError(f"'{path}', tensor '{key}': the checkpoint has shape {list(tensor.shape)}, "
                                          f"the model {list(targets[key].shape)}")  # fmt: skip
                targets[key].data.copy_(tensor)


def _check_names(path: str, saved: set[str], targets: dict[str, torch.Tensor], strict: bool) -> None:
    # Tied weights are saved once: a missing name is fine when a saved one shares its memory.
    saved_memory = {targets[k].data_ptr() for k in saved if k in targets and targets[k].numel()}
    missing = [k for k in targets if k not in saved and not (targets[k].numel() and targets[k].data_ptr() in saved_memory)]
    unexpected = sorted(saved - set(targets))
    if strict and (missing or unexpected):
        raise CheckpointError(f"'{path}' does not fit the model: missing {missing or 'nothing'}, "
                              f"unexpected {unexpected or 'nothing'}")  # fmt: skip


def _restore_loader(loader: Any, state: dict) -> None:
    from accel.data.loaders import get_sampler

    if hasattr(loader, "set_epoch"):
        loader.set_epoch(state.get("iteration", 0))
    sampler = get_sampler(loader)
    if state.get("initial_seed") is not None and hasattr(sampler, "initial_seed"):
        sampler.initial_seed = state["initial_seed"]


def _load_custom_objects(objects: list, folder: str, load_kwargs: dict) -> None:
    found = sorted(f for f in os.listdir(folder) if re.fullmatch(r"custom_checkpoint_\d+\.pkl", f))
    if len(found) != len(objects):
        raise RuntimeError(f"'{folder}' holds {len(found)} custom checkpoints but {len(objects)} objects are registered "
                           "(register_for_checkpointing): load a checkpoint saved with the same registrations")  # fmt: skip
    for i, obj in enumerate(objects):
        obj.load_state_dict(_load(os.path.join(folder, f"custom_checkpoint_{i}.pkl"), load_kwargs))


def _numpy_rng_globals() -> list:
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_rng_state(folder: str, process_index: int) -> int | None:
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
