"""Model weights on disk in Hugging Face's layout: `save_model` and `load_checkpoint_in_model`.

One file `model.safetensors`, or shards `model-00001-of-0000N.safetensors` with `model.safetensors.index.json`
(`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`), split greedily in state-dict order as
huggingface_hub's `split_torch_state_dict_into_shards` does; `.bin` files (`pytorch_model*.bin`) when
`safe_serialization=False`. Tensors that share memory (tied weights) are saved once, under their first name,
as transformers does. Every file is written under a temporary name, then all are published together through a
journal (the index renamed last), so a save killed at any moment leaves the previous checkpoint or the new one:
accel's next save or load of the folder replays an interrupted journal (other readers may meet the few files
renamed so far, in the microseconds between the renames). Saves come in three modes (accel.checkpoint.background).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Mapping

import torch

from accel.checkpoint import background, snapshot
from accel.checkpoint.atomic_files import (
    exchange,
    fsync_directory,
    process_alive,
    remove_quietly,
    write_atomically,
    write_temporary,
)
from accel.checkpoint.background import SaveMode
from accel.checkpoint.names import (
    PUBLISH_JOURNAL,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from accel.checkpoint.progress import progress_bar
from accel.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from accel.checkpoint.safetensors_io import write_temporary as write_temporary_safetensors

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str, what: str = "max_shard_size") -> int:
    """`"10GB"` -> 10_000_000_000, `"5MiB"` -> 5_242_880 (decimal and binary units, as huggingface_hub).

    `what` names the argument in the error."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"{what}: cannot read {size!r} as a size (e.g. '10GB', '500MiB', 1000000)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def without_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every tensor that shares memory with an earlier one dropped (logged), as transformers
    saves tied weights once; loading ties them again through the model."""
    seen: dict[tuple, str] = {}
    kept = {}
    for name, tensor in state_dict.items():
        if tensor.numel() == 0 or tensor.device.type == "meta":
            kept[name] = tensor
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
               tuple(tensor.shape), tuple(tensor.stride()))  # fmt: skip
        if key in seen:
            logger.info("not saving '%s': it shares its memory with '%s'", name, seen[key])
            continue
        seen[key] = name
        kept[name] = tensor
    return kept


def split_into_shards(state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str, filename_pattern: str
                      ) -> tuple[dict[str, list[str]], int]:  # fmt: skip
    """({file name: tensor names}, total bytes): a tensor larger than the limit gets a shard of its own, otherwise a
    new shard starts when the next tensor would not fit. `filename_pattern` has a `{suffix}` field."""
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return {filename_pattern.format(suffix=""): shards[0]}, total
    count = len(shards)
    return {filename_pattern.format(suffix=f"-{i + 1:05d}-of-{count:05d}"): names for i, names in enumerate(shards)}, total


def save_state_dict(state_dict: Mapping[str, torch.Tensor], save_directory: str | os.PathLike,
                    max_shard_size: int | str = "10GB", safe_serialization: bool = True,
                    progress: bool | None = None, *, durable: bool = True) -> list[str]:  # fmt: skip
    """Writes `state_dict` as (sharded) weights into `save_directory`; returns the files written.

    Every file is written under a temporary name first; then they are published together through a journal
    (`.accel-publish.json`: renames, or swaps with the files they replace, the index last; then removal of the
    indexes of an earlier save that this one does not overwrite, in either format), so a process killed at any
    moment leaves the previous checkpoint or the new one: the next save or load replays an interrupted journal.
    The replaced files and the earlier save's other weight files, which nothing names any more, are unlinked before
    it returns, and their blocks freed in the background (accel.checkpoint.background.unlink_now_free_later:
    freeing is what costs ~30 ms per 100 MiB; nothing in the folder changes after the call). `durable`: fsync every file
    and the folder before returning; without it the files are complete in the page cache (a kill cannot lose
    them, a power loss can) and `sync_files` makes them durable later. `progress`: see accel.checkpoint.progress.
    """
    folder = os.fspath(save_directory)
    if os.path.isfile(folder):
        raise ValueError(f"save_directory '{folder}' is a file, expected a folder")
    os.makedirs(folder, exist_ok=True)
    replay_journal(folder)
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    state_dict = without_shared_tensors(state_dict)
    stem, extension = os.path.splitext(weights_name)
    shards, total = split_into_shards(state_dict, max_shard_size, stem + "{suffix}" + extension)
    staged: list[tuple[str, str]] = []  # (temporary, final name)
    try:
        with progress_bar(total, f"saving {folder}", progress) as bar:
            for filename, names in shards.items():
                shard = {name: state_dict[name].detach() for name in names}
                staged.append((_write_shard(shard, os.path.join(folder, filename), safe_serialization, durable), filename))
                bar.update(sum(t.numel() * t.element_size() for t in shard.values()))
        if len(shards) > 1:
            index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: filename for filename, names in shards.items() for name in names}}  # fmt: skip
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            staged.append((write_temporary(os.path.join(folder, index_name), lambda f: f.write(text), "w", durable=durable),
                           index_name))  # fmt: skip
        new = {name for _, name in staged}
        stale = [name for name in os.listdir(folder) if _WEIGHT_FILE.fullmatch(name) and name not in new]
    except BaseException:
        for temporary, _ in staged:
            remove_quietly(temporary)
        raise
    # Once its journal is written, the publish is decided: an interruption from here on is completed by a replay.
    background.unlink_now_free_later(publish_files(folder, staged, stale, durable))
    _remove_orphan_temporaries(folder)
    return [os.path.join(folder, name) for _, name in staged]


def _write_shard(shard: dict[str, torch.Tensor], path: str, safe_serialization: bool, durable: bool) -> str:
    if safe_serialization:
        return write_temporary_safetensors(shard, path, metadata={"format": "pt"}, durable=durable)
    tensors = {name: t.contiguous().cpu() for name, t in shard.items()}
    return write_temporary(path, lambda f: torch.save(tensors, f), durable=durable)


def publish_files(folder: str, renames: list[tuple[str, str]], remove: list[str], durable: bool) -> list[str]:
    """Moves the complete temporary files `renames` ((temporary path, final name), in order) into place and
    removes the indexes named in `remove`, as one step for readers that replay the journal (see save_state_dict).

    An existing file is swapped with its replacement (renameat2 RENAME_EXCHANGE: cheaper than a rename over it)
    and left at the temporary name. Returns what is left to remove (those old files, the stale shards in
    `remove`): nothing reads them any more, so the caller removes them after (`unlink_now_free_later`)."""
    plan = {"rename": [[os.path.basename(t), name, os.stat(t).st_ino] for t, name in renames], "remove": remove}
    text = json.dumps(plan)
    try:
        write_atomically(os.path.join(folder, PUBLISH_JOURNAL), lambda f: f.write(text), mode="w", durable=durable)
    except BaseException:
        for temporary, _ in renames:
            remove_quietly(temporary)
        raise
    leftovers = _move_into_place(folder, plan)
    for name in remove:
        if name.endswith(".index.json"):  # no index may name a shard once its own shards are gone
            remove_quietly(os.path.join(folder, name))
    if durable:
        fsync_directory(folder)
    remove_quietly(os.path.join(folder, PUBLISH_JOURNAL))
    return leftovers + [os.path.join(folder, name) for name in remove if not name.endswith(".index.json")]


def _move_into_place(folder: str, plan: dict) -> list[str]:
    """Renames (or swaps) each journaled file into place unless done already: a temporary name that holds the
    journaled inode still has the new file, another inode there is the old file a swap left. Returns the old
    files left at temporary names."""
    leftovers = []
    for temporary, name, inode in plan["rename"]:
        source, target = os.path.join(folder, temporary), os.path.join(folder, name)
        try:
            moved = os.lstat(source).st_ino != inode
        except FileNotFoundError:
            continue  # renamed already
        if not moved and not (os.path.lexists(target) and exchange(source, target)):
            os.replace(source, target)
            continue
        leftovers.append(source)
    return leftovers


def replay_journal(folder: str) -> None:
    """Completes the publish a killed save left in `folder` (its journal), if any; every step checks what is done
    already, so a reader and the writer may both replay it."""
    journal = os.path.join(folder, PUBLISH_JOURNAL)
    try:
        with open(journal) as f:
            plan = json.load(f)
    except FileNotFoundError:
        return
    except ValueError:  # written atomically, so never partial: not ours
        raise CheckpointError(f"'{journal}' is not a journal accel wrote; remove it") from None
    leftovers = _move_into_place(folder, plan) + [os.path.join(folder, name) for name in plan["remove"]]
    background.unlink_now_free_later(leftovers)
    remove_quietly(journal)


def sync_files(paths: list[str]) -> None:
    """fsyncs `paths` and their folders: the durability a non-durable `save_state_dict` left for later."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # replaced or removed by a later save, which syncs its own
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for folder in dict.fromkeys(os.path.dirname(path) or "." for path in paths):
        fsync_directory(folder)


def save_model_files(state_dict: Mapping[str, torch.Tensor], save_directory: str | os.PathLike,
                     max_shard_size: int | str, safe_serialization: bool, mode: SaveMode) -> None:  # fmt: skip
    """`Accelerator.save_model` in the three save modes (accel.checkpoint.background): the files complete when it
    returns and durable in the background (default), durable when it returns, or written in the background from
    a snapshot (asynchronous; the worker writes it durably, then publishes). An earlier asynchronous save is joined
    (and its failure raised) first."""
    background.saves.join(asynchronous_only=True)
    folder = os.fspath(save_directory)
    if mode.asynchronous:
        state = snapshot.buffers.take(without_shared_tensors(state_dict))

        write = functools.partial(save_state_dict, state, folder, max_shard_size, safe_serialization, progress=False,
                                  durable=True)  # fmt: skip
        background.saves.submit(write, f"save_model into '{folder}'", asynchronous=True)
        return
    written = save_state_dict(state_dict, folder, max_shard_size, safe_serialization, durable=mode.durable)
    if not mode.durable:
        background.saves.submit(lambda: sync_files(written), f"fsync of '{folder}'")


def _remove_orphan_temporaries(folder: str) -> None:
    """The temporary files of saves killed midway (their process is gone)."""
    for name in os.listdir(folder):
        match = _ORPHAN_TEMPORARY.fullmatch(name)
        if match and not process_alive(int(match.group(1))):
            os.remove(os.path.join(folder, name))


_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


_ORPHAN_TEMPORARY = re.compile(r"\.(?:model|pytorch_model)[^/]*\.tmp-(\d+)-[0-9a-f]+")



# --- loading -------------------------------------------------------------------------------------------------------


def checkpoint_files(checkpoint: str | os.PathLike) -> list[str]:
    """The weight files of `checkpoint`: one file, the files an index names, or what a folder holds."""
    path = os.fspath(checkpoint)
    _complete_interrupted_save(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    if os.path.isdir(path):
        for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME):
            if os.path.isfile(os.path.join(path, name)):
                return checkpoint_files(os.path.join(path, name))
        raise FileNotFoundError(f"'{path}' holds no {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or index of either")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"'{path}' is not a checkpoint index (no weight_map): {error}") from None
        folder = os.path.dirname(path)
        files = [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(f"'{path}' names shards that do not exist: {', '.join(missing)}")
        return files
    return [path]


def _complete_interrupted_save(folder: str) -> None:
    if not os.path.exists(os.path.join(folder, PUBLISH_JOURNAL)):
        return
    if not os.access(folder, os.W_OK):
        raise CheckpointError(f"a save into '{folder}' was interrupted while publishing its files, and this process "
                              "cannot complete it (the folder is read-only to it): load it once with write access")  # fmt: skip
    replay_journal(folder)


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike,
    device_map: dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    progress: bool | None = None,
) -> None:
    """Loads a checkpoint (one file, a sharded index or a folder; safetensors or `.bin`) into `model` in place.

    Each safetensors tensor is validated, then read straight into the parameter or buffer it belongs to
    (converted when dtypes differ); `.bin` files are read with `torch.load(weights_only=True)`. Missing or
    unexpected names raise when `strict`, else are logged as a warning; a shape that does not match raises,
    naming the tensor. `dtype` converts floating-point weights to that dtype. `progress`: see
    accel.checkpoint.progress.
    """
    if device_map is not None or offload_folder is not None or offload_state_dict or offload_buffers:
        raise NotImplementedError("device_map and offloading in load_checkpoint_in_model are not supported by accel "
                                  "yet (big-model inference); load on the model's own devices (device_map=None)")
    if offload_8bit_bnb:
        raise NotImplementedError("offload_8bit_bnb is not supported by accel")
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    destinations = _destinations(model, dtype, keep_in_fp32_modules or [])
    found: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(checkpoint)
    with progress_bar(sum(os.path.getsize(f) for f in files), f"loading {os.fspath(checkpoint)}", progress) as bar:
        for path in files:
            names = _load_file_into(path, destinations)
            found.update(n for n in names if n in destinations)
            unexpected.extend(n for n in names if n not in destinations)
            bar.update(os.path.getsize(path))
    # Tied weights are saved once: a name whose memory another loaded name shares is loaded too.
    loaded_memory = {_memory_key(destinations[name]) for name in found}
    missing = [name for name in destinations if name not in found and _memory_key(destinations[name]) not in loaded_memory]
    _report_mismatch(missing, unexpected, strict, os.fspath(checkpoint))


def _memory_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype) if tensor.numel() else (id(tensor),)


def _destinations(model: torch.nn.Module, dtype: torch.dtype | None, keep_fp32: list[str]) -> dict[str, torch.Tensor]:
    """name -> the tensor to load into: the parameter or buffer itself, converted first when `dtype` says so."""
    destinations = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if dtype is not None and tensor.is_floating_point() and not any(m in name for m in keep_fp32):
            tensor.data = tensor.data.to(dtype)
        destinations[name] = tensor.data
    return destinations


def _load_file_into(path: str, destinations: dict[str, torch.Tensor]) -> list[str]:
    """Reads the tensors of one file that `destinations` names; returns every name in the file."""
    if path.endswith(".safetensors"):
        with SafetensorsFile(path) as f:  # validated and read through one descriptor
            # In the model's order, so that a checkpoint of another architecture names the model's first mismatch.
            f.read_into({name: tensor for name, tensor in destinations.items() if name in f.header.tensors})
            return list(f.header.tensors)
    with open(path, "rb") as f:
        state_dict = torch.load(f, map_location="cpu", weights_only=True)
    with torch.no_grad():
        for name, tensor in state_dict.items():
            if name in destinations:
                if tuple(tensor.shape) != tuple(destinations[name].shape):
                    raise CheckpointError(f"'{path}', tensor '{name}': the checkpoint has shape {list(tensor.shape)}, "
                                          f"the destination {list(destinations[name].shape)}")  # fmt: skip
                destinations[name].copy_(tensor)
    return list(state_dict)


def _report_mismatch(missing: list[str], unexpected: list[str], strict: bool, checkpoint: str) -> None:
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    message = f"loading '{checkpoint}': " + "; ".join(parts)
    if strict:
        raise CheckpointError(message)
    logger.warning(message)
