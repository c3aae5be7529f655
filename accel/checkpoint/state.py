"""save_state / load_state: a training run's whole state in HF Accelerate's folder layout, written atomically.

Files (HF's names, so its users find what they expect):
  model.safetensors, model_1.safetensors, ...   each prepared model's state dict (pytorch_model*.bin without
                                                safe_serialization); keys as the prepared model names them,
                                                as HF does ("module." under DDP); loading accepts either form
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
    one that load_state would pick;
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
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import secrets
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from accel.checkpoint import background, snapshot
from accel.checkpoint.atomic_files import exchange, fsync_directory, process_alive, remove_quietly, write_atomically
from accel.checkpoint.background import Durability, SaveMode, durability_of, make_durable, remove_tree_now_free_later
from accel.checkpoint.model_io import without_shared_tensors
from accel.checkpoint.names import (
    CHECKPOINT_FILE,
    CHECKPOINT_PATTERN,
    CUSTOM_CHECKPOINT_NAME,
    DATALOADER_STATE_NAME,
    DURABILITY_RECORD,
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
from accel.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_file

logger = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


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


def partial_name(final: str, node: int | None = None) -> str:
    """The hidden staging folder next to `final` (one per node when every node saves its own copy)."""
    folder, name = os.path.split(os.path.normpath(final))
    return os.path.join(folder, f".{name}.partial" + ("" if node is None else f"-node{node}"))


def can_stage_beside(final: str) -> bool:
    """Whether a staging folder next to `final` can be renamed onto it: the parent is writable and on the same
    filesystem as `final` (not so when `final` is a mount point, e.g. a volume mounted for checkpoints)."""
    parent = os.path.dirname(os.path.normpath(final)) or "."
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:  # created along with the staging folder
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        return False
    return not os.path.exists(final) or os.stat(final).st_dev == os.stat(parent).st_dev


def foreign_entries(final: str, staged: str) -> list[str]:
    """What an existing `final` holds besides checkpoint files and what the new checkpoint brings (logs, other
    runs' folders...): a folder swap would delete those."""
    if not os.path.isdir(final):
        return []
    new = set(os.listdir(staged))
    return sorted(n for n in os.listdir(final) if n not in new and not CHECKPOINT_FILE.fullmatch(n))


def publish(partial: str, final: str, durable: bool = True) -> None:
    """Moves the complete `partial` folder to `final`; an existing `final` is swapped out in one step.

    When `final` holds other things than a checkpoint (see foreign_entries), they are kept: the new files are
    moved in one by one instead (each file atomically, the folder as a whole not). `durable`: fsync the folders
    (else accel.checkpoint.background.Durability does it later).
    """
    sync = fsync_directory if durable else (lambda folder: None)
    sync(partial)  # every entry of the folder is durable before it is renamed into place
    foreign = foreign_entries(final, partial)
    if foreign:
        logger.warning("'%s' holds other things than a checkpoint (%s): replacing its checkpoint files one by one "
                       "(not atomically) so that they are kept", final, ", ".join(foreign[:5]))  # fmt: skip
        # The new record first: it replaces the old checkpoint's, which would no longer hold for the new files.
        for name in sorted(os.listdir(partial), key=lambda name: name != DURABILITY_RECORD):
            os.replace(os.path.join(partial, name), os.path.join(final, name))
        sync(final)  # the renames into it, not only its own entry in the parent
        os.rmdir(partial)
    elif not os.path.exists(final):
        os.rename(partial, final)
    elif exchange(partial, final):
        discard(partial)  # now the previous checkpoint
    else:  # no renameat2 here: two renames, with the old folder kept until the new one is in place
        old = partial + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        discard(old)
    sync(os.path.dirname(os.path.normpath(final)) or ".")


def recover_interrupted_publish(final: str) -> None:
    """A crash between the two renames of publish's fallback left the previous checkpoint at `.NAME.partial.old`
    (`.NAME.partial-node<K>.old` when every node saves its own copy) and nothing at `final`: put it back."""
    if os.path.exists(final):
        return
    parent, name = os.path.split(os.path.normpath(final))
    parent = parent or "."
    parked = re.compile(re.escape(f".{name}.partial") + r"(-node\d+)?\.old")
    for candidate in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        old = os.path.join(parent, candidate)
        if parked.fullmatch(candidate) and os.path.isdir(old):
            logger.warning("restoring '%s' from '%s' (a save was interrupted)", final, old)
            os.rename(old, final)
            return


# --- saving ------------------------------------------------------------------------------------------------------


def save_state(accelerator: Any, output_dir: str | None, safe_serialization: bool,
               pre_hooks: list[Callable], mode: SaveMode = SaveMode(durable=True)) -> str:  # fmt: skip
    """Writes the state of everything `accelerator` prepared into `output_dir` (see the module docstring), in one
    of the three save modes of accel.checkpoint.background.

    Every process calls it (it synchronizes them three times: the staging folder exists, every file is in place,
    the checkpoint is published); a failure on any process raises on all of them and publishes nothing. With
    `mode.asynchronous`, the saving process snapshots its files' contents and writes and publishes them in the
    background; the others return once their own files are written.
    """
    config = accelerator.project_configuration
    root, output_dir = _target(accelerator, output_dir)
    # A process that names another folder than the main process's (each its own temporary folder, as HF's tests
    # do) writes a whole checkpoint there, so that its load_state finds one (and its staging folder is published).
    own_folder = not _same_folder_as_main(accelerator, output_dir)  # a collective: every process calls it
    writes_shared_files = accelerator._saves_here() or own_folder
    node = _node_index(accelerator) if config.save_on_each_node else None
    staged = can_stage_beside(output_dir)
    staging = partial_name(output_dir, node) if staged else output_dir
    if not staged and writes_shared_files:
        logger.warning("cannot stage '%s' next to it (parent not writable, or a mount point): writing in place, "
                       "not atomically", output_dir)  # fmt: skip
    failure = None
    try:
        background.saves.join(asynchronous_only=True)  # an earlier asynchronous save is published (or raises) first
        if writes_shared_files:
            _prepare_staging(output_dir, staging, staged)
    except Exception as error:  # noqa: BLE001 - reported on every process below
        failure = error
    _agree_or_raise(accelerator, failure, "preparing")  # the staging folder exists for every process

    files: dict[str, Any] = {}
    try:
        os.makedirs(staging, exist_ok=True)  # processes on other nodes' disks
        weights = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
        for hook in pre_hooks:  # (models, weights, folder): a hook may pop what it saves itself, HF-style
            hook(list(accelerator._models), weights, staging)
        if writes_shared_files:
            files = shared_files(accelerator, weights, safe_serialization)
            if not mode.asynchronous:
                write_files(staging, files, durable=mode.durable)
        save_rng_state(staging, accelerator.process_index, accelerator.step, durable=mode.durable)
    except Exception as error:  # noqa: BLE001
        failure = error
    _agree_or_raise(accelerator, failure, "writing", cleanup=staging if staged and writes_shared_files else None)

    try:
        if writes_shared_files:
            # An asynchronous save is published durable (by the worker): its caller does not wait for the fsync.
            finish = functools.partial(_publish_and_rotate, staging if staged else None, output_dir, root,
                                       config.total_limit, mode.durable or mode.asynchronous)  # fmt: skip
            if mode.asynchronous:
                snapshot_of_files = snapshot.buffers.take(files)
                background.saves.submit(lambda: (write_files(staging, snapshot_of_files, durable=False), finish()),
                                        f"save_state into '{output_dir}'", asynchronous=True)  # fmt: skip
            else:
                finish()
    except Exception as error:  # noqa: BLE001
        failure = error
    _agree_or_raise(accelerator, failure, "publishing")  # nobody returns before the checkpoint is visible
    config.iteration += 1
    return output_dir


def _prepare_staging(output_dir: str, staging: str, staged: bool) -> None:
    recover_interrupted_publish(output_dir)
    sweep_discarded(os.path.dirname(os.path.normpath(output_dir)) or ".")
    if staged:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
    else:  # written in place: the record of the checkpoint being overwritten no longer holds
        remove_quietly(os.path.join(staging, DURABILITY_RECORD))
    os.makedirs(staging, exist_ok=True)


def _publish_and_rotate(staging: str | None, output_dir: str, root: str | None, total_limit: int | None,
                        durable: bool) -> None:  # fmt: skip
    """Creates the complete staging folder's durability record, renames the folder into place, then rotates
    numbered checkpoints. `durable`: everything is fsync'd and recorded durable before the folder is published;
    else that completes on the worker after, and rotation keeps the newest durable checkpoint until a join point
    finds the new one durable (see rotate_until_complete)."""
    durability = Durability.start(staging or output_dir)
    try:
        if durable:
            durability.complete()
        if staging is not None:
            publish(staging, output_dir, durable=durable)
        if not durable:
            durability.moved_to(output_dir)  # where the files are now (the staging folder itself, mostly)
    except BaseException:
        durability.close()
        raise
    try:  # before the worker starts the fsyncs: they would hold up these unlinks (the filesystem's journal)
        if root is not None and total_limit is not None:
            rotate_until_complete(root, total_limit, output_dir)
    finally:
        if not durable:
            background.saves.submit(durability.complete, f"durability of '{output_dir}'")


def _node_index(accelerator: Any) -> int:
    """Which machine this process is on (processes are numbered node by node, as torchrun does)."""
    from accel.environment import get_cpu_distributed_information

    return accelerator.process_index // max(1, get_cpu_distributed_information().local_world_size)


def _target(accelerator: Any, output_dir: str | None) -> tuple[str | None, str]:
    """(the checkpoints root with automatic naming, else None; the folder to save into)."""
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        if accelerator.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs a project_dir (ProjectConfiguration(project_dir=...))")
        if config.total_limit is not None and config.total_limit < 1:
            raise ValueError(f"total_limit must be at least 1, got {config.total_limit}")
        root = os.path.join(accelerator.project_dir, "checkpoints")
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


def _same_folder_as_main(accelerator: Any, output_dir: str) -> bool:
    """Whether the main process saves into `output_dir` too (one broadcast of its path)."""
    if accelerator.num_processes == 1:
        return True
    from accel import collectives

    return collectives.broadcast_object_list([output_dir])[0] == output_dir


def _agree_or_raise(accelerator: Any, failure: BaseException | None, stage: str, cleanup: str | None = None) -> None:
    """A barrier that also tells every process whether any failed, so all raise instead of some waiting forever."""
    failed = failure is not None
    if accelerator.num_processes > 1:
        from accel import collectives

        flag = torch.tensor([1 if failed else 0], device=accelerator.device)
        failed = bool(collectives.reduce(flag, reduction="sum").item())
    if not failed:
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if failure is not None:
        raise failure
    raise RuntimeError(f"save_state failed on another process while {stage}; nothing was published")


def rotate(root: str, keep: int, newest: str) -> bool:
    """Removes the lowest-numbered checkpoints under `root` so that `keep` remain, never `newest` (the one just
    written: it may be numbered below older runs' checkpoints in the same folder), and, while `newest` is not
    durable yet, never the newest checkpoint that is (a power loss now must leave one to load). Returns whether
    the rotation is complete (False: a checkpoint was kept for `newest`'s durability)."""
    others = [f for f in numbered_checkpoints(root) if os.path.normpath(f) != os.path.normpath(newest)]
    doomed = others[: max(0, len(others) + 1 - keep)]
    complete = True
    if durability_of(newest) not in ("durable", "unknown"):
        safe = [f for f in others if durability_of(f) in ("durable", "unknown")]
        complete = not (safe and safe[-1] in doomed)
        doomed = [f for f in doomed if not safe or f != safe[-1]]
    for old in doomed:
        logger.warning("removing checkpoint '%s' (total_limit=%d)", old, keep)
        discard(old)
    return complete


def rotate_until_complete(root: str, keep: int, newest: str) -> None:
    """Rotates now and, if a checkpoint had to be kept until `newest` is durable, again at each join point the
    user calls (accel.checkpoint.background.BackgroundSaves.defer) until it is removed: never from the worker,
    so no directory changes behind the user's back."""
    if not rotate(root, keep, newest):
        background.saves.defer(f"rotation of '{root}'", functools.partial(rotate, root, keep, newest))


_DISCARDED = re.compile(r"\..+\.discarded-(\d+)-[0-9a-f]+")


def discard(folder: str) -> None:
    """Removes `folder` before returning: renamed first to a hidden name (`.NAME.discarded-PID-RANDOM`), so that a
    process killed midway never leaves a partial checkpoint under a checkpoint's name (the next save into the same
    parent folder sweeps it: `sweep_discarded`), then its entries removed. Only freeing the blocks of its large
    files, the slow part (~30 ms per 100 MiB), is left to the background: nothing changes in the parent folder
    after the call that discarded it returns."""
    parent, name = os.path.split(os.path.normpath(folder))
    hidden = os.path.join(parent, f".{name.lstrip('.')}.discarded-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(folder, hidden)
    except FileNotFoundError:
        return
    try:
        remove_tree_now_free_later(hidden)
    except OSError as error:
        logger.warning("could not remove the replaced checkpoint '%s' (now at '%s'): %s", folder, hidden, error)


def sweep_discarded(parent: str) -> None:
    """Deletes what `discard` left in `parent` for processes that died before deleting it."""
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        match = _DISCARDED.fullmatch(name)
        if match and not process_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def shared_files(accelerator: Any, weights: list[dict], safe_serialization: bool) -> dict[str, Any]:
    """{file name: what goes in it} for the files one process writes for all: weights (a state dict per model,
    `.safetensors` or `.bin`), optimizers, schedulers, dataloaders, scaler, registered objects. The objects'
    state dicts are taken now; an asynchronous save copies them before it returns."""
    files: dict[str, Any] = {}
    for i, state_dict in enumerate(weights):
        if safe_serialization:
            files[numbered(SAFE_MODEL_NAME, i, ".safetensors")] = without_shared_tensors(state_dict)
        else:
            files[numbered(MODEL_NAME, i, ".bin")] = state_dict
    for i, optimizer in enumerate(accelerator._optimizers):
        files[numbered(OPTIMIZER_NAME, i, ".bin")] = optimizer.state_dict()
    for i, scheduler in enumerate(accelerator._schedulers):
        files[numbered(SCHEDULER_NAME, i, ".bin")] = scheduler.state_dict()
    for i, loader in enumerate(accelerator._dataloaders):
        files[numbered(SAMPLER_NAME, i, ".bin")] = loader_state(loader)
        if getattr(loader, "use_stateful_dataloader", False):
            files[numbered(DATALOADER_STATE_NAME, i, ".bin")] = loader.state_dict()
    if accelerator.scaler is not None:
        files[SCALER_NAME] = accelerator.scaler.state_dict()
    for i, obj in enumerate(accelerator._custom_objects):
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
    from accel.data.loaders import get_sampler

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


def latest_checkpoint(accelerator: Any) -> str:
    """The newest `checkpoints/checkpoint_N` that is durable (or unmarked: HF's, an older accel's). One published
    without fsync during this boot is made durable now (its bytes are in the page cache); one published without
    fsync before the machine restarted is passed over for an older durable one (its bytes may be lost)."""
    root = os.path.join(accelerator.project_dir or ".", "checkpoints")
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


def load_state(accelerator: Any, input_dir: str | None, load_kwargs: dict | None, pre_hooks: list[Callable],
               strict: bool = True) -> str:  # fmt: skip
    """Restores everything `accelerator` prepared from `input_dir` (default: the latest numbered checkpoint).

    Every file it needs is checked to be there before anything is restored, so a wrong folder changes nothing.
    """
    config = accelerator.project_configuration
    background.saves.join(asynchronous_only=True)  # this process's asynchronous save is published first
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError("load_state needs input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
        input_dir = latest_checkpoint(accelerator)
    input_dir = os.path.expanduser(os.fspath(input_dir))
    recover_interrupted_publish(input_dir)
    if not os.path.isdir(input_dir):
        raise ValueError(f"checkpoint folder '{input_dir}' does not exist")
    if durability_of(input_dir) == "lost-boot":
        logger.warning("'%s' was saved without fsync before this machine restarted: its files may be incomplete",
                       input_dir)  # fmt: skip
    load_kwargs = {"weights_only": True, **(load_kwargs or {})}
    models = list(accelerator._models)  # a hook may pop the models it loads itself (HF's diffusers pattern)
    for hook in pre_hooks:
        hook(models, input_dir)
    _check_complete(accelerator, models, input_dir)
    for i, model in enumerate(models):
        load_model_weights(model, input_dir, i, strict)
    for i, optimizer in enumerate(accelerator._optimizers):
        optimizer.load_state_dict(_load(os.path.join(input_dir, numbered(OPTIMIZER_NAME, i, ".bin")), load_kwargs))
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(_load(os.path.join(input_dir, numbered(SCHEDULER_NAME, i, ".bin")), load_kwargs))
    for i, loader in enumerate(accelerator._dataloaders):
        restore_loader_files(loader, input_dir, i, load_kwargs)
    if accelerator.scaler is not None and os.path.exists(os.path.join(input_dir, SCALER_NAME)):
        accelerator.scaler.load_state_dict(_load(os.path.join(input_dir, SCALER_NAME), load_kwargs))
    _load_custom_objects(accelerator._custom_objects, input_dir, load_kwargs)
    step = load_rng_state(input_dir, accelerator.process_index)
    if step is not None:
        accelerator.step = step
    number = checkpoint_number(input_dir)
    if config.automatic_checkpoint_naming and number is not None:
        config.iteration = number + 1  # the next save_state continues the numbering
    return input_dir


def _check_complete(accelerator: Any, models: list, folder: str) -> None:
    """Raises, naming what is missing, unless `folder` holds a file for everything that will be restored."""
    missing = []
    for i in range(len(models)):
        if not any(os.path.exists(os.path.join(folder, numbered(name, i, ext)))
                   for name, ext in ((SAFE_MODEL_NAME, ".safetensors"), (MODEL_NAME, ".bin"))):  # fmt: skip
            missing.append(numbered(SAFE_MODEL_NAME, i, ".safetensors"))
    missing += [numbered(OPTIMIZER_NAME, i, ".bin") for i in range(len(accelerator._optimizers))]
    missing += [numbered(SCHEDULER_NAME, i, ".bin") for i in range(len(accelerator._schedulers))]
    missing = [name for name in missing if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(f"'{folder}' is not a complete checkpoint for what was prepared: missing "
                                f"{', '.join(missing)}")  # fmt: skip
    found = [f for f in os.listdir(folder) if re.fullmatch(rf"{CUSTOM_CHECKPOINT_NAME}_\d+\.pkl", f)]
    if len(found) != len(accelerator._custom_objects):
        raise RuntimeError(f"'{folder}' holds {len(found)} custom checkpoints but {len(accelerator._custom_objects)} "
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
    from accel.data.loaders import get_sampler

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
