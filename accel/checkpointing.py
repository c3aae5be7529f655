"""`accelerate.checkpointing`'s functions: a training state saved from and loaded into lists of objects.

`Accelerator.save_state` / `load_state` (accel.checkpoint.training_state) are what scripts call; these are the
lower-level functions HF exposes, writing the same files (HF's layout: `model.safetensors`, `optimizer.bin`,
`scheduler.bin`, `sampler.bin`, `dl_state_dict.bin` (stateful dataloaders), `scaler.pt`, `random_states_{rank}.pkl`,
`custom_checkpoint_{i}.pkl`, `_1`, `_2`, ... for further objects), so a folder written by either is read by the
other. Differences from HF:

- every shared file is written by the main process only (HF writes `scaler.pt` and `dl_state_dict.bin` from every
  process at once: a dispatched loader's file is then right or wrong depending on which write lands last), each
  under a temporary name renamed into place, so a crash never leaves a half-written file;
- nothing is unpickled beyond `weights_only=True` unless asked: `load_kwargs={"weights_only": False}` (HF's
  `load_custom_state` always unpickles; accel's takes `load_kwargs` for objects that need it);
- `sampler.bin` holds every dataloader's epoch and sampler seed (HF saves a sampler only for iterable datasets).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint.names import (
    DATALOADER_STATE_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    SAFE_MODEL_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    custom_checkpoint_name,
    numbered,
)
from accel.checkpoint.object_io import load, save
from accel.checkpoint.training_state import (
    load_model_weights,
    load_rng_state,
    loader_state,
    restore_loader_files,
    save_rng_state,
)
from accel.state import PartialState

logger = logging.getLogger(__name__)


def save_accelerator_state(
    output_dir: str | os.PathLike,
    model_states: list[dict],
    optimizers: list,
    schedulers: list,
    dataloaders: list,
    process_index: int,
    step: int,
    scaler: Any = None,
    save_on_each_node: bool = False,
    safe_serialization: bool = True,
) -> Path:
    """Saves model state dicts, optimizers, schedulers, dataloader positions, the gradient scaler and this process's
    RNG states into `output_dir` (created if needed). Every process calls it: the shared files are written by the
    main process (of each machine with `save_on_each_node`), the RNG file by every process.

    Args:
        output_dir: the checkpoint folder.
        model_states: the models' state dicts, in order.
        optimizers / schedulers / dataloaders: objects whose state is saved, in order.
        process_index: this process's rank (names its RNG file).
        step: the training step saved with the RNG states.
        scaler: the fp16 `GradScaler`, if any.
        save_on_each_node: every machine writes its own copy (no shared filesystem).
        safe_serialization: models as safetensors (else `pytorch_model.bin`); the rest is always torch.save'd.

    Returns:
        `output_dir` as a Path.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for i, state_dict in enumerate(model_states):
        name = numbered(SAFE_MODEL_NAME, i, ".safetensors") if safe_serialization else numbered(MODEL_NAME, i, ".bin")
        save(state_dict, output_dir / name, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
    for i, optimizer in enumerate(optimizers):
        save(optimizer.state_dict(), output_dir / numbered(OPTIMIZER_NAME, i, ".bin"), save_on_each_node)
    for i, scheduler in enumerate(schedulers):
        save(scheduler.state_dict(), output_dir / numbered(SCHEDULER_NAME, i, ".bin"), save_on_each_node)
    for i, dataloader in enumerate(dataloaders):
        save(loader_state(dataloader), output_dir / numbered(SAMPLER_NAME, i, ".bin"), save_on_each_node)
        if getattr(dataloader, "use_stateful_dataloader", False):
            save(dataloader.state_dict(), output_dir / numbered(DATALOADER_STATE_NAME, i, ".bin"), save_on_each_node)
    if scaler is not None:
        save(scaler.state_dict(), output_dir / SCALER_NAME, save_on_each_node)
    save_rng_state(os.fspath(output_dir), process_index, step, PartialState().num_processes)
    logger.info("training state saved in %s", output_dir)
    return output_dir


def _map_location(map_location: str | None) -> str | torch.device:
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError(
            f"Unsupported optimizer map location {map_location!r}: choose one of None, 'cpu' or 'on_device'"
        )
    if map_location == "on_device":
        return PartialState().device
    return "cpu"


def load_accelerator_state(
    input_dir: str | os.PathLike,
    models: list,
    optimizers: list,
    schedulers: list,
    dataloaders: list,
    process_index: int,
    scaler: Any = None,
    map_location: str | None = None,
    load_kwargs: dict | None = None,
    **load_model_func_kwargs: Any,
) -> dict:
    """Loads what `save_accelerator_state` saved into the given objects (in the same order).

    Args:
        input_dir: the checkpoint folder.
        models / optimizers / schedulers / dataloaders: objects to restore, in the order they were saved.
        process_index: this process's rank (names its RNG file).
        scaler: the fp16 `GradScaler` to restore, if any.
        map_location: where optimizer states are loaded: None or "cpu", or "on_device" (this process's device).
        load_kwargs: passed to `torch.load` for optimizers, schedulers, the scaler (`weights_only=True` unless set).
        **load_model_func_kwargs: `strict` (default True): every weight name must match the model's.

    Returns:
        The Accelerator attributes to override: {"step": the saved step} when the RNG file holds one.
    """
    strict = load_model_func_kwargs.pop("strict", True)
    if load_model_func_kwargs:
        raise TypeError(
            f"load_accelerator_state: unknown model loading arguments {sorted(load_model_func_kwargs)}; "
            "only `strict` is supported"
        )
    location = _map_location(map_location)
    load_kwargs = dict(load_kwargs or {})
    input_dir = os.fspath(input_dir)
    for i, model in enumerate(models):
        load_model_weights(model, input_dir, i, strict)
    for i, optimizer in enumerate(optimizers):
        path = os.path.join(input_dir, numbered(OPTIMIZER_NAME, i, ".bin"))
        optimizer.load_state_dict(load(path, map_location=location, **load_kwargs))
    for i, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(load(os.path.join(input_dir, numbered(SCHEDULER_NAME, i, ".bin")), **load_kwargs))
    for i, dataloader in enumerate(dataloaders):
        restore_loader_files(dataloader, input_dir, i, {"weights_only": True, **load_kwargs})
    if scaler is not None:
        scaler.load_state_dict(load(os.path.join(input_dir, SCALER_NAME), **load_kwargs))
    step = load_rng_state(input_dir, process_index)
    logger.info("training state loaded from %s", input_dir)
    return {} if step is None else {"step": step}


def save_custom_state(obj: Any, path: str | os.PathLike, index: int = 0, save_on_each_node: bool = False) -> None:
    """Saves `obj.state_dict()` to `{path}/custom_checkpoint_{index}.pkl` (from the main process)."""
    save(obj.state_dict(), Path(path) / custom_checkpoint_name(index), save_on_each_node)


def load_custom_state(obj: Any, path: str | os.PathLike, index: int = 0, load_kwargs: dict | None = None) -> None:
    """Loads `{path}/custom_checkpoint_{index}.pkl` into `obj.load_state_dict`.

    Loaded with `weights_only=True` (tensors, numbers, strings, containers, numpy arrays); a state dict holding other
    Python objects needs `load_kwargs={"weights_only": False}` (HF always unpickles: trusted files only).
    """
    obj.load_state_dict(load(Path(path) / custom_checkpoint_name(index), map_location="cpu", **(load_kwargs or {})))
