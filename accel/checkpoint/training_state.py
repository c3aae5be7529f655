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
  - the checkpoint is written into a new hidden staging folder next to its final place (created exclusively under
    an unpredictable name, so nothing planted there is written through) and renamed there only once every
    process's files are in it (an existing folder of that name is swapped out atomically with
    renameat2(RENAME_EXCHANGE)), so a crash mid-save leaves the previous checkpoint intact and never a partial
    one that load_state would pick (staging, publishing, rotation: accel.checkpoint.publish); the publishing
    process holds the folder's lock meanwhile, so two jobs saving into one folder never mix their files
    (accel.checkpoint.target_lock);
  - load_state, wait_for_checkpoint and end_training wait for every process's asynchronous save, so all
    processes load the same checkpoint; the step comes from the main process's file, and a checkpoint saved by
    another number of processes loads with a warning and distinct RNG states on every process;
  - saves come in three modes (accel.checkpoint.background): by default the call returns once the files are
    complete and published from the page cache, as fast as HF's save, and durability (fsync, then the record
    `.accel-durability` rewritten to say so) follows in the background without changing any directory entry;
    `durable_save` waits for it; `async_save` returns after an in-memory snapshot of what the process writes,
    and its worker does the rest (the lock, the staging folder, the writes, the publish and every exchange between
    the processes that they need: the call exchanges only its folder's name with the main process, and the
    staging folder's when save_state pre-hooks write into it);
  - a replaced or rotated-out checkpoint is gone before the call returns (its blocks are freed in the background:
    that is the slow part of a removal);
  - with automatic_checkpoint_naming, old checkpoints are rotated out by checkpoint number (not string order),
    after the new one is in place; the newest durable one stays until the new one is durable too, and is removed
    at the next call that joins the background (the next save, load_state, wait_for_checkpoint, end_training, or
    the interpreter's exit): with total_limit=N, N+1 checkpoints may exist until then. `load_state()` loads the
    latest durable one (see latest_checkpoint) and sets the iteration so the next save gets the next number;
  - nothing is unpickled beyond weights_only=True (numpy's RNG arrays are allowlisted for the RNG files); pass
    `load_kwargs={"weights_only": False}` for custom objects whose state dicts hold arbitrary Python objects;
  - a failure on one process (a full disk, a hook raising) raises on every process, and nothing is published;
    a failed asynchronous save raises at the next join point, or makes the process exit with status 1.
Two cases give up atomicity rather than data: a folder that holds other things than a checkpoint (logs...) gets
its checkpoint files replaced one by one, and a folder that cannot be staged beside (a mount point, a read-only
parent) is written in place. save_state and load_state are collective: every process must call them.

What is saved comes from the Accelerator through one seam, `Accelerator.checkpointable()` (a `Checkpointable`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from accel import collectives
from accel.checkpoint import background, shard_stager, snapshot
from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.background import SaveMode
from accel.checkpoint.durability import durability_of, sync_published
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
    discard,
    numbered_checkpoints,
    prepare_staging,
    publish_and_rotate,
    readable_folder,
)
from accel.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_file
from accel.checkpoint.sharded import FullStates, ShardedStates, StagedShards, write_group
from accel.checkpoint.target_lock import TargetLock
from accel.data import get_sampler
from accel.environment import get_cpu_distributed_information
from accel.wire.process_group import wait_limit

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
    # How models' and optimizers' state is saved when it is sharded (FSDP2's DCP folders); None: whole files.
    sharded: ShardedStates | FullStates | None = None


# --- saving ------------------------------------------------------------------------------------------------------


def save_state(
    parts: Checkpointable,
    output_dir: str | None,
    safe_serialization: bool,
    pre_hooks: list[Callable],
    mode: SaveMode = SaveMode(durable=True),
) -> str:
    """Writes the state of everything in `parts` into `output_dir` (see the module docstring), in one of the three
    save modes of accel.checkpoint.background.

    Every process calls it; a failure on any process fails the save on all of them and publishes nothing. The
    process that publishes holds the folder's lock (accel.checkpoint.target_lock) from staging to publishing, so a
    second job saving into the same folder waits for it. A synchronous save synchronizes the processes three times
    (the staging folder exists, every file is in place, the checkpoint is published) and raises a failure on every
    process. With `mode.asynchronous`, the call only copies what this process writes and hands the rest to its
    checkpoint worker (`_BackgroundSave`: see `_save_in_background`).
    """
    if mode.asynchronous:
        return _save_in_background(parts, output_dir, safe_serialization, pre_hooks)
    config = parts.project_configuration
    root, output_dir = _target(parts, output_dir)
    # A process that names another folder than the main process's (each its own temporary folder, as HF's tests
    # do) writes a whole checkpoint there, so that its load_state finds one (and its staging folder is published).
    own_folder = not _same_folder_as_main(parts, output_dir)  # a collective: every process calls it
    writes_shared_files = parts.writes_shared_files or own_folder
    staged = _can_stage(output_dir, writes_shared_files)
    failure = _write_and_publish(
        parts, output_dir, root, staged, writes_shared_files, safe_serialization, pre_hooks, mode.durable
    )
    _agree_or_raise(parts, failure, "publishing")  # nobody returns before the checkpoint is visible
    config.iteration += 1
    return output_dir


def _write_and_publish(
    parts: Checkpointable,
    output_dir: str,
    root: str | None,
    staged: bool,
    writes_shared_files: bool,
    safe_serialization: bool,
    pre_hooks: list[Callable],
    durable: bool,
) -> BaseException | None:
    """A synchronous save's work up to its last exchange: the staging folder (agreed by every process), this
    process's files, then the publish. A failure before the publish raises on every process; one of the publish
    is returned, for every process to learn in the caller's last exchange."""
    lock, staging = _prepare_and_agree(parts, output_dir, staged, writes_shared_files)
    try:
        cleanup = staging if staged and writes_shared_files else None
        _write_own_files(parts, staging, writes_shared_files, safe_serialization, pre_hooks, durable, cleanup)
        if not writes_shared_files:
            return None
        try:
            publish_and_rotate(
                staging if staged else None, output_dir, root, parts.project_configuration.total_limit, durable
            )
        except Exception as error:  # noqa: BLE001 - reported on every process by the caller
            return error
        return None
    finally:
        if lock is not None:
            lock.release()


def _prepare_and_agree(
    parts: Checkpointable, output_dir: str, staged: bool, writes_shared_files: bool
) -> tuple[TargetLock | None, str]:
    """A save's staging folder, made at the call: earlier asynchronous saves are joined, the writer takes the
    folder's lock and prepares the folder, and every process learns it in one exchange (or every process raises).
    Returns the lock, held by the writer (None elsewhere), and the folder."""
    lock = staging = failure = None
    try:
        background.saves.join(asynchronous_only=True)  # an earlier asynchronous save is published (or raises)
        if writes_shared_files:
            lock = TargetLock.acquire(output_dir, wait_limit().total_seconds())
            staging = prepare_staging(output_dir, staged)
    except Exception as error:  # noqa: BLE001 - reported on every process below
        failure = error
    try:
        return lock, _agree_on_staging(parts, failure, output_dir, _writer_node(parts), staging)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _write_own_files(
    parts: Checkpointable,
    staging: str,
    writes_shared_files: bool,
    safe_serialization: bool,
    pre_hooks: list[Callable],
    durable: bool,
    cleanup: str | None,
) -> None:
    """Writes this process's files into `staging` (and the shared files, on their writer). Every process agrees on
    the outcome; on a failure anywhere `cleanup` is removed and every process raises."""
    failure = None
    try:
        os.makedirs(staging, exist_ok=True)  # processes on other nodes' disks
        weights = _run_hooks(parts, staging, pre_hooks)
        if parts.sharded is not None:  # sharded state (FSDP2) is written by every process through DCP
            parts.sharded.save(list(parts.models), _inner(parts.optimizers), staging, durable=durable)
        if writes_shared_files:
            write_files(staging, shared_files(parts, weights, safe_serialization), durable=durable)
        write_files(staging, _own_files(parts), durable=durable)
    except Exception as error:  # noqa: BLE001
        failure = error
    _agree_or_raise(parts, failure, "writing", cleanup=cleanup)


def _run_hooks(parts: Checkpointable, folder: str | None, pre_hooks: list[Callable]) -> list[dict]:
    """The whole weights the writer saves (a state dict per model; none when the state is sharded), after the
    pre-hooks ran with them and `folder`: a hook may pop what it saves itself, HF-style."""
    weights = [] if parts.sharded is not None else [parts.state_dict(model) for model in parts.models]
    for hook in pre_hooks:
        hook(list(parts.models), weights, folder)
    return weights


def _own_files(parts: Checkpointable) -> dict[str, Any]:
    """The files this process writes for itself: its RNG states."""
    return {rng_file(parts.process_index): rng_states(parts.step, parts.num_processes)}


# --- saving asynchronously ---------------------------------------------------------------------------------------


def _save_in_background(
    parts: Checkpointable, output_dir: str | None, safe_serialization: bool, pre_hooks: list[Callable]
) -> str:
    """save_state with `async_save`. The call does this process's work only: it names the folder, learns whether
    it writes the shared files (the one exchange), joins this process's previous asynchronous save, copies what
    this process writes (`_snapshot`) and hands the rest to its checkpoint worker (`_BackgroundSave`). When
    something writes into the staging folder at the call (any process's pre-hooks, a DeepSpeed engine's
    checkpoint), every process prepares and agrees on that folder first. A failure at the call raises there and
    is handed over too, so that the other processes' workers learn it; theirs raise at the next join point."""
    root, output_dir = _target(parts, output_dir)
    same_folder, hooked = _same_folder_and_any_hooks(parts, output_dir, bool(pre_hooks))  # the one exchange
    writes_shared_files = parts.writes_shared_files or not same_folder
    # The workers exchange over a gloo group of their own (training's collectives run on the default group
    # meanwhile), made at the first asynchronous save: every process asks for it at the same save.
    group = write_group(wait_limit()) if parts.num_processes > 1 else None
    save = _BackgroundSave(
        parts,
        output_dir,
        root,
        parts.project_configuration.total_limit,
        writes_shared_files,
        _writer_node(parts),
        group,
        wait_limit().total_seconds(),
    )
    try:
        if hooked or _written_at_call(parts):  # the staging folder is agreed at the call, on every process
            save.staged = _can_stage(output_dir, writes_shared_files)
            save.lock, save.staging = _prepare_and_agree(parts, output_dir, save.staged, writes_shared_files)
        else:
            background.saves.join(asynchronous_only=True)  # the copies below reuse the previous save's memory
        save.files, save.own, save.shards = _snapshot(
            parts, save.staging, writes_shared_files, safe_serialization, pre_hooks
        )
    except BaseException as error:
        save.failure = error
        raise
    finally:
        background.saves.submit(save.run, f"save_state into '{output_dir}'", asynchronous=True)
        parts.project_configuration.iteration += 1  # also when this call failed: the others' calls took the number
    return output_dir


def _snapshot(
    parts: Checkpointable,
    folder: str | None,
    writes_shared_files: bool,
    safe_serialization: bool,
    pre_hooks: list[Callable],
) -> tuple[dict[str, Any], dict[str, Any], StagedShards | None]:
    """What an asynchronous save of this process writes, copied now: the shared files on their writer (FULL_STATE_DICT's
    gathered files with them), its own files, and its part of the sharded state (ShardedStates.stage). The pre-hooks
    run first, with the staging folder `folder`, and an engine's checkpoint is written there now."""
    if folder is not None:  # agreed at the call: something writes into it now
        os.makedirs(folder, exist_ok=True)  # processes on other nodes' disks
    weights = _run_hooks(parts, folder, pre_hooks)
    models, optimizers = list(parts.models), _inner(parts.optimizers)
    shards, gathered = None, {}
    if isinstance(parts.sharded, ShardedStates):
        shards = parts.sharded.stage(models, optimizers, wait_limit())
    elif isinstance(parts.sharded, FullStates):
        gathered = parts.sharded.gather(models, optimizers)  # every process takes part; the main process gets them
    elif parts.sharded is not None:  # made durable by the publish
        parts.sharded.save(models, optimizers, folder)
    files = {}
    if writes_shared_files:
        files = snapshot.buffers.take({**gathered, **shared_files(parts, weights, safe_serialization)})
    return files, _own_files(parts), shards


def _written_at_call(parts: Checkpointable) -> bool:
    """Whether the state is written into the staging folder at the call: an engine's own checkpoint (DeepSpeed's),
    which has no copy to hand over (the same on every process: one strategy)."""
    return parts.sharded is not None and not isinstance(parts.sharded, (ShardedStates, FullStates))


@dataclasses.dataclass
class _BackgroundSave:
    """An asynchronous save_state on the checkpoint worker (`run`): the writer takes the folder's lock and prepares
    the staging folder, every process learns it, writes its files and its part of the sharded state, the writer
    publishes, and every process learns each step's outcome, so that a failure anywhere raises at every process's
    next join point, removes the staging folder and publishes nothing. Every process hands one over at every
    asynchronous save, also when its call failed (`failure`: it only tells the others), so that the workers'
    exchanges, over `group` and each bounded by its timeout, pair up."""

    parts: Checkpointable
    output_dir: str
    root: str | None  # the checkpoints root with automatic naming (rotation)
    total_limit: int | None
    writes_shared_files: bool
    node: int | None  # with save_on_each_node, this process's machine
    group: dist.ProcessGroup | None  # the asynchronous saves' gloo group; None: one process
    timeout_s: float  # the longest wait for the folder's lock
    files: dict[str, Any] = dataclasses.field(default_factory=dict)  # the shared files' copy (on their writer)
    own: dict[str, Any] = dataclasses.field(default_factory=dict)
    shards: StagedShards | None = None
    staged: bool = False  # the writer stages beside the folder (else it writes in place)
    staging: str | None = None  # prepared at the call when something writes into it there, else by `run`
    lock: TargetLock | None = None  # the writer's, from staging to publishing
    failure: BaseException | None = None  # the call's, raised there

    def run(self) -> None:
        try:
            staging = self._agree_on_staging()
            self._write(staging)
            self._publish(staging)
        except BaseException as error:
            self._discard()  # a failure anywhere, or a lost peer: nothing is published (a published folder is gone)
            if error is not self.failure:  # the call raised its own failure already
                raise
        finally:
            self._release()

    def _agree_on_staging(self) -> str:
        """The staging folder, prepared by the writer and learnt by every process, with whether any failed so far
        (then every process raises, and the writer removes its folder)."""
        failure = self.failure
        if failure is None and self.staging is None and self.writes_shared_files:
            try:
                self.lock = TargetLock.acquire(self.output_dir, self.timeout_s)
                self.staged = _can_stage(self.output_dir, True)
                self.staging = prepare_staging(self.output_dir, self.staged)
            except Exception as error:  # noqa: BLE001 - reported on every process below
                failure = error
        return _agree_on_staging(self.parts, failure, self.output_dir, self.node, self.staging, self.group)

    def _write(self, staging: str) -> None:
        """This process's part of the sharded state (first: DCP's exchanges need every process), its own files and,
        on the writer, the shared files; every process learns whether any failed (then all raise and the staging
        folder goes)."""
        failure = None
        try:
            if self.shards is not None:
                self.shards.write(staging)
            os.makedirs(staging, exist_ok=True)  # processes on other nodes' disks
            write_files(staging, self.own, durable=True)  # published durable: the caller did not wait for the fsync
            if self.writes_shared_files:
                write_files(staging, self.files, durable=False)  # fsync'd by the publish
        except BaseException as error:  # noqa: BLE001 - reported everywhere below
            failure = error
        _agree_or_raise(self.parts, failure, "writing", group=self.group)

    def _publish(self, staging: str) -> None:
        """The writer publishes (durable) and releases the lock; every process learns whether it failed."""
        failure = None
        if self.writes_shared_files:
            try:
                publish_and_rotate(
                    staging if self.staged else None, self.output_dir, self.root, self.total_limit, durable=True
                )
            except Exception as error:  # noqa: BLE001 - reported on every process below
                failure = error
                self._discard()  # before the lock goes
            self._release()
        _agree_or_raise(self.parts, failure, "publishing", group=self.group)

    def _discard(self) -> None:
        """Removes the writer's staging folder (not a folder written in place); once published, there is none."""
        if self.staged and self.writes_shared_files and self.staging is not None:
            discard(self.staging)

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()


# --- agreeing ----------------------------------------------------------------------------------------------------


def _agree_on_staging(
    parts: Checkpointable,
    failure: BaseException | None,
    output_dir: str,
    node: int | None,
    staging: str | None,
    group: dist.ProcessGroup | None = None,
) -> str:
    """The staging folder this process writes into: the one it created, else its writer's (the main process's,
    or with save_on_each_node its `node`'s), learnt in one exchange (over `group`, else the default group) that
    also tells every process whether any failed to prepare (then all raise)."""
    if parts.num_processes == 1:
        if failure is not None:
            raise failure
        return staging
    reports = _gather((failure is not None, output_dir, node, staging), group)
    if failure is not None:
        raise failure
    failed = [rank for rank, report in enumerate(reports) if report[0]]
    if failed:
        raise RuntimeError(f"save_state failed on process {failed[0]} while preparing; nothing was published")
    if staging is not None:
        return staging
    for _, folder, writer_node, writer_staging in reports:
        if writer_staging is not None and folder == output_dir and writer_node == node:
            return writer_staging
    raise RuntimeError(
        f"save_state into '{output_dir}': no process writes the shared files for this one "
        f"(process {parts.process_index}, node {node})"
    )


def _gather(report: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every process's `report`, in process order, gathered over `group` (the checkpoint worker's), else over the
    default group (the caller's)."""
    if group is None:
        return collectives.gather_object([report])
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    return reports


def _writer_node(parts: Checkpointable) -> int | None:
    """With save_on_each_node, the machine whose writer this process's files go with; else None (the main
    process's)."""
    return _node_index(parts) if parts.project_configuration.save_on_each_node else None


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
            raise ValueError(
                f"checkpoint folder '{output_dir}' (iteration {config.iteration}) already exists; set "
                "accelerator.project_configuration.iteration to the number to continue from"
            )
        return root, output_dir
    if output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    output_dir = os.path.realpath(os.path.expanduser(os.fspath(output_dir)))  # a symlinked folder: stage by the target
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"save_state: '{output_dir}' exists and is not a folder")
    return None, output_dir


def _can_stage(output_dir: str, writes_shared_files: bool) -> bool:
    """Whether the save into `output_dir` is staged beside it (see publish.can_stage_beside); its writer warns
    when it is not."""
    staged = can_stage_beside(output_dir)
    if not staged and writes_shared_files:
        logger.warning(
            "cannot stage '%s' next to it (parent not writable, or a mount point): writing in place, not atomically",
            output_dir,
        )
    return staged


def _same_folder_as_main(parts: Checkpointable, output_dir: str) -> bool:
    """Whether the main process saves into `output_dir` too (one broadcast of its path)."""
    if parts.num_processes == 1:
        return True
    return collectives.broadcast_object_list([output_dir])[0] == output_dir


def _same_folder_and_any_hooks(parts: Checkpointable, output_dir: str, hooked: bool) -> tuple[bool, bool]:
    """(whether the main process saves into `output_dir` too, whether any process has save_state pre-hooks), in
    one exchange."""
    if parts.num_processes == 1:
        return True, hooked
    reports = collectives.gather_object([(output_dir, hooked)])
    return reports[0][0] == output_dir, any(hooks for _, hooks in reports)


def _agree_or_raise(
    parts: Checkpointable,
    failure: BaseException | None,
    stage: str,
    cleanup: str | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """A barrier (over `group`, else the default group) that also tells every process whether any failed, so all
    raise instead of some waiting forever."""
    if not _any_failed(parts, failure, group):
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if failure is not None:
        raise failure
    raise RuntimeError(f"save_state failed on another process while {stage}; nothing was published")


def _any_failed(parts: Checkpointable, failure: BaseException | None, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `failure` happened here or on any other process (a collective over `group`, else the default group:
    every process calls it; after the process group was destroyed, as by a second end_training, only this process
    can say)."""
    failed = failure is not None
    if parts.num_processes > 1 and dist.is_initialized():
        if group is None:
            flag = torch.tensor([1 if failed else 0], device=parts.device)
            failed = bool(collectives.reduce(flag, reduction="sum").item())
        else:  # a gloo group: a CPU tensor
            flag = torch.tensor([1 if failed else 0])
            dist.all_reduce(flag, group=group)
            failed = bool(flag.item())
    return failed


def join_saves(parts: Checkpointable, asynchronous_only: bool = False) -> None:
    """A join point on every process: waits for this process's background saves (with `asynchronous_only`, until
    its last asynchronous save is published), then for every other process's, so that what any process saved
    is published everywhere on return; a failure of any process's raises on all of them. Every process calls it
    (load_state, wait_for_checkpoint and end_training do)."""
    failure = None
    try:
        background.saves.join(asynchronous_only=asynchronous_only)
    except Exception as error:  # noqa: BLE001 - reported on every process below
        failure = error
    if not _any_failed(parts, failure):
        return
    if failure is not None:
        raise failure
    raise RuntimeError("a checkpoint saved in the background on another process failed (its error is raised there)")


def finish(parts: Checkpointable) -> None:
    """The end of training: waits for every process's saves (raising a failure on every process), then frees the
    asynchronous snapshot."""
    try:
        join_saves(parts)
    finally:
        snapshot.buffers.release()
        shard_stager.stager.release()


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
    for i, optimizer in enumerate(parts.optimizers if parts.sharded is None else []):
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


def save_rng_state(folder: str, process_index: int, step: int, num_processes: int, durable: bool = True) -> None:
    """Writes `rng_states` to `folder/random_states_{process_index}.pkl` (fsync'd when `durable`)."""
    write_files(folder, {rng_file(process_index): rng_states(step, num_processes)}, durable=durable)


def rng_states(step: int, num_processes: int) -> dict[str, Any]:
    """This process's python / numpy / torch (/ CUDA) RNG states, `step` and the number of processes that saved:
    the content of its `random_states_{i}.pkl`. HF's loader reads the same file and ignores the extra key."""
    states = {
        "step": step,
        "num_processes": num_processes,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def rng_file(process_index: int) -> str:
    return f"{RNG_STATE_NAME}_{process_index}.pkl"


# --- loading -----------------------------------------------------------------------------------------------------


def latest_checkpoint(project_dir: str | None) -> str:
    """The newest `checkpoints/checkpoint_N` that is durable (or unmarked: HF's, an older accel's). One published
    without fsync during this boot is fsync'd now (its bytes are in the page cache; its record stays the writer's
    to complete: a load changes nothing on disk); one published without fsync before the machine restarted is
    passed over for an older durable one (its bytes may be lost)."""
    root = os.path.join(project_dir or ".", "checkpoints")
    folders = numbered_checkpoints(root)
    if not folders:
        raise FileNotFoundError(f"no checkpoint_N folder in '{root}' to load")
    for folder in reversed(folders):
        state = durability_of(folder)
        if state == "this-boot":
            sync_published(folder)
        if state != "lost-boot":
            if folder != folders[-1]:
                logger.warning(
                    "loading '%s': the newer checkpoints were saved without fsync before this machine "
                    "restarted, so their files may be incomplete",
                    folder,
                )
            return folder
    logger.warning(
        "every checkpoint in '%s' was saved without fsync before this machine restarted; loading the "
        "newest, '%s', whose files may be incomplete",
        root,
        folders[-1],
    )
    return folders[-1]


def load_state(
    parts: Checkpointable,
    input_dir: str | None,
    load_kwargs: dict | None,
    pre_hooks: list[Callable],
    strict: bool = True,
) -> tuple[str, int | None]:
    """Restores everything in `parts` from `input_dir` (default: the latest numbered checkpoint); returns the folder
    and the step saved with the main process's RNG states (None when it has none: the step stays as it is).

    Every process calls it. It first waits until every process's asynchronous save is published (so all load
    the same checkpoint), and every file it needs is checked to be there on every process before anything is
    restored, so a wrong folder changes nothing. The step comes from the main process's file, the same on every
    process. A checkpoint saved by another number of processes loads with a warning: each process restores its
    own RNG states where the checkpoint has them, and derives new ones from process (index mod saved count)'s
    otherwise. Loading changes nothing on disk.
    """
    join_saves(parts, asynchronous_only=True)
    with contextlib.ExitStack() as views:  # a view of an interrupted publish is removed when the load is done
        return _load_state(parts, input_dir, load_kwargs, pre_hooks, strict, views)


def _load_state(
    parts: Checkpointable,
    input_dir: str | None,
    load_kwargs: dict | None,
    pre_hooks: list[Callable],
    strict: bool,
    views: contextlib.ExitStack,
) -> tuple[str, int | None]:
    config = parts.project_configuration
    load_kwargs = {"weights_only": True, **(load_kwargs or {})}
    models = list(parts.models)  # a hook may pop the models it loads itself (HF's diffusers pattern)
    failure = folder = None
    try:
        input_dir, folder = _folder_to_load(config, parts.project_dir, input_dir, views)
        for hook in pre_hooks:
            hook(models, folder)
        _check_complete(parts, models, folder)
    except Exception as error:  # noqa: BLE001 - reported on every process below
        failure = error
    if _any_failed(parts, failure):
        raise failure or RuntimeError(
            "load_state failed on another process (its error is raised there); nothing was loaded"
        )
    failure = own_rng = None
    try:
        _restore_files(parts, models, folder, load_kwargs, strict)
        own_rng = _read_rng_states(folder, parts.process_index)
    except Exception as error:  # noqa: BLE001 - reported on every process below
        failure = error
    step, saved_by = _agree_on_saved_run(parts, failure, folder, own_rng)
    _restore_rng_states(parts, folder, own_rng, saved_by)
    number = checkpoint_number(input_dir)
    if config.automatic_checkpoint_naming and number is not None:
        config.iteration = number + 1  # the next save_state continues the numbering
    return input_dir, step


def _folder_to_load(
    config: Any, project_dir: str | None, input_dir: str | None, views: contextlib.ExitStack
) -> tuple[str, str]:
    """(the checkpoint asked for, the folder its files are read from: the same, where an interrupted save parked
    it, or a view of what an interrupted publish into a folder holding other things published, which `views`
    removes)."""
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError("load_state needs input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
        input_dir = latest_checkpoint(project_dir)
    input_dir = os.path.expanduser(os.fspath(input_dir))
    folder = views.enter_context(readable_folder(input_dir))
    if not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder '{input_dir}' does not exist")
    if durability_of(folder) == "lost-boot":
        logger.warning(
            "'%s' was saved without fsync before this machine restarted: its files may be incomplete", input_dir
        )
    return input_dir, folder


def _check_complete(parts: Checkpointable, models: list, folder: str) -> None:
    """Raises, naming what is missing, unless `folder` holds a file for everything that will be restored."""
    missing = []
    sharded = _sharded_states(parts, models, folder)
    if sharded is not None:
        missing += sharded.missing(folder, len(models), len(parts.optimizers))
        models = []  # their state is in the DCP folders
    for i in range(len(models)):
        if not any(
            os.path.exists(os.path.join(folder, numbered(name, i, ext)))
            for name, ext in ((SAFE_MODEL_NAME, ".safetensors"), (MODEL_NAME, ".bin"))
        ):
            missing.append(numbered(SAFE_MODEL_NAME, i, ".safetensors"))
    missing += [numbered(OPTIMIZER_NAME, i, ".bin") for i in range(len(parts.optimizers) if sharded is None else 0)]
    missing += [numbered(SCHEDULER_NAME, i, ".bin") for i in range(len(parts.schedulers))]
    missing = [name for name in missing if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(
            f"'{folder}' is not a complete checkpoint for what was prepared: missing {', '.join(missing)}"
        )
    found = [f for f in os.listdir(folder) if re.fullmatch(rf"{CUSTOM_CHECKPOINT_NAME}_\d+\.pkl", f)]
    if len(found) != len(parts.custom_objects):
        raise RuntimeError(
            f"'{folder}' holds {len(found)} custom checkpoints but {len(parts.custom_objects)} "
            "objects are registered (register_for_checkpointing): load a checkpoint saved with the "
            "same registrations"
        )


def _sharded_states(parts: Checkpointable, models: list, folder: str) -> ShardedStates | FullStates | None:
    """How the models' and optimizers' state is read: as this run's strategy writes it (FSDP's sharded DCP folders
    or full files), or, in another setup, as the folder holds it when it has no model.safetensors /
    pytorch_model.bin (an FSDP checkpoint: DCP reshards, full files are read whole); None: whole files."""
    if parts.sharded is not None:
        return parts.sharded
    whole = any(
        os.path.exists(os.path.join(folder, numbered(name, 0, ext)))
        for name, ext in ((SAFE_MODEL_NAME, ".safetensors"), (MODEL_NAME, ".bin"))
    )
    if whole:
        return None
    return next((kind() for kind in (ShardedStates, FullStates) if kind.present(folder, len(models))), None)


def _inner(optimizers: list) -> list[torch.optim.Optimizer]:
    """The user's optimizers inside the prepared wrappers."""
    return [getattr(optimizer, "optimizer", optimizer) for optimizer in optimizers]


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
                mapping = {key[len(prefix) :]: name for key, name in mapping.items()}
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
            raise CheckpointError(
                f"'{path}', tensor '{key}': the checkpoint has shape {list(tensor.shape)}, "
                f"the model {list(targets[key].shape)}"
            )
    with torch.no_grad():
        for key, tensor in state_dict.items():
            if key in targets:
                targets[key].data.copy_(tensor)


def _check_names(path: str, saved: set[str], targets: dict[str, torch.Tensor], strict: bool) -> None:
    # Tied weights are saved once: a missing name is fine when a saved one shares its memory.
    saved_memory = {targets[k].data_ptr() for k in saved if k in targets and targets[k].numel()}
    missing = [
        k for k in targets if k not in saved and not (targets[k].numel() and targets[k].data_ptr() in saved_memory)
    ]
    unexpected = sorted(saved - set(targets))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"'{path}' does not fit the model: missing {missing or 'nothing'}, unexpected {unexpected or 'nothing'}"
        )


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
    return [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def load_rng_state(folder: str, process_index: int) -> int | None:
    """Restores the RNG states `save_rng_state` wrote for `process_index`; returns the step saved with them (None
    when the file is missing). One process's view; load_state uses `restore_rng_states`."""
    states = _read_rng_states(folder, process_index)
    if states is None:
        logger.info("no random states for process %d in '%s'", process_index, folder)
        return None
    _set_rng_states(states)
    return states.get("step")


def _restore_files(parts: Checkpointable, models: list, folder: str, load_kwargs: dict, strict: bool) -> None:
    sharded = _sharded_states(parts, models, folder)
    if sharded is not None:
        # The scaler first: loading an optimizer's sharded state may initialise it with a step (HF's order).
        if parts.scaler is not None and os.path.exists(os.path.join(folder, SCALER_NAME)):
            parts.scaler.load_state_dict(_load(os.path.join(folder, SCALER_NAME), load_kwargs))
        sharded.load(models, _inner(parts.optimizers), folder)
    for i, model in enumerate(models if sharded is None else []):
        load_model_weights(model, folder, i, strict)
    for i, optimizer in enumerate(parts.optimizers if sharded is None else []):
        optimizer.load_state_dict(_load(os.path.join(folder, numbered(OPTIMIZER_NAME, i, ".bin")), load_kwargs))
    for i, scheduler in enumerate(parts.schedulers):
        scheduler.load_state_dict(_load(os.path.join(folder, numbered(SCHEDULER_NAME, i, ".bin")), load_kwargs))
    for i, loader in enumerate(parts.dataloaders):
        restore_loader_files(loader, folder, i, load_kwargs)
    if parts.scaler is not None and os.path.exists(os.path.join(folder, SCALER_NAME)):
        parts.scaler.load_state_dict(_load(os.path.join(folder, SCALER_NAME), load_kwargs))
    _load_custom_objects(parts.custom_objects, folder, load_kwargs)


def _agree_on_saved_run(
    parts: Checkpointable, failure: BaseException | None, folder: str, own_rng: dict | None
) -> tuple[int | None, int]:
    """(the saved step, how many processes saved) as the main process's folder says, the same on every process,
    in one exchange that also tells every process whether any failed to load (then all raise). The count is
    the one the RNG files record, else the number of them (HF's, older accel's)."""
    saved_by = own_rng.get("num_processes") if own_rng is not None else None
    if saved_by is None and failure is None:
        saved_by = sum(1 for name in os.listdir(folder) if re.fullmatch(rf"{RNG_STATE_NAME}_\d+\.pkl", name))
    report = (failure is not None, own_rng.get("step") if own_rng is not None else None, saved_by)
    reports = collectives.gather_object([report]) if parts.num_processes > 1 else [report]
    if failure is not None:
        raise failure
    failed = [rank for rank, (failed, _, _) in enumerate(reports) if failed]
    if failed:
        raise RuntimeError(f"load_state failed on process {failed[0]} (its error is raised there)")
    return reports[0][1], reports[0][2]


def _restore_rng_states(parts: Checkpointable, folder: str, own: dict | None, saved_by: int) -> None:
    """Restores this process's RNG states from `folder` (`own`: its file's content, if it has one). When the
    checkpoint was saved by another number of processes, a process without its own file derives its states from
    process (index mod `saved_by`)'s, distinct per process, and the main process warns naming both numbers."""
    if saved_by and saved_by != parts.num_processes and parts.process_index == 0:
        logger.warning(
            "'%s' was saved by %d processes and is loaded by %d: the step is the main process's; "
            "processes without random states of their own derive them from another process's, so "
            "random numbers (and the data order) differ from an uninterrupted run",
            folder,
            saved_by,
            parts.num_processes,
        )
    if own is not None:
        _set_rng_states(own)
        return
    base = _read_rng_states(folder, parts.process_index % saved_by) if saved_by else None
    if base is None:
        logger.info("no random states for process %d in '%s'", parts.process_index, folder)
        return
    _set_rng_states(base)
    _reseed_for(base, parts.process_index)


def _read_rng_states(folder: str, process_index: int) -> dict | None:
    path = os.path.join(folder, rng_file(process_index))
    if not os.path.exists(path):
        return None
    with torch.serialization.safe_globals(_numpy_rng_globals()):  # numpy's RNG state is an array
        return torch.load(path, weights_only=True)


def _set_rng_states(states: dict) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _reseed_for(base: dict, process_index: int) -> None:
    """Seeds every generator from `base`'s torch state and `process_index`: the same on every load, different
    for every process (two processes with one state would draw the same dropout masks)."""
    digest = hashlib.sha256(base["torch_manual_seed"].numpy().tobytes() + process_index.to_bytes(8, "little"))
    seed = int.from_bytes(digest.digest()[:8], "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
