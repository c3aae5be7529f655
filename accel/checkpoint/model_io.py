"""Model weights on disk in Hugging Face's layout: `save_model` and `load_checkpoint_in_model`.

One file `model.safetensors`, or shards `model-00001-of-0000N.safetensors` with `model.safetensors.index.json`
(`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`), split greedily in state-dict order as
huggingface_hub's `split_torch_state_dict_into_shards` does; `.bin` files (`pytorch_model*.bin`) when
`safe_serialization=False`. Tensors that share memory (tied weights) are saved once, under their first name,
as transformers does. Every file is written under a temporary name, then all are published together through a
journal (the index renamed last), so a save killed at any moment leaves the previous checkpoint or the new one:
accel's next save into the folder completes an interrupted publish, and accel's loads read the new checkpoint
through the journal meanwhile, changing nothing (other readers may meet the few files renamed so far, in the
microseconds between the renames). Loading never writes: a journal or an index from elsewhere that names files
outside its folder is refused. Saves come in three modes (accel.checkpoint.background).
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
from accel.checkpoint.atomic_files import TEMPORARY_NAME, fsync_directory, remove_quietly, write_temporary
from accel.checkpoint.background import SaveMode
from accel.checkpoint.names import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHT_FILE,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from accel.checkpoint.progress import progress_bar
from accel.checkpoint.publish_journal import (
    PublishJournal,
    publish_entries,
    remove_now_free_later,
    remove_orphan_temporaries,
    replay_journal,
)
from accel.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from accel.checkpoint.safetensors_io import write_temporary as write_temporary_safetensors
from accel.checkpoint.target_lock import TargetLock
from accel.wire.process_group import wait_limit

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


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
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if key in seen:
            logger.info("not saving '%s': it shares its memory with '%s'", name, seen[key])
            continue
        seen[key] = name
        kept[name] = tensor
    return kept


def split_into_shards(
    state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str, filename_pattern: str
) -> tuple[dict[str, list[str]], int]:
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
    return {
        filename_pattern.format(suffix=f"-{i + 1:05d}-of-{count:05d}"): names for i, names in enumerate(shards)
    }, total


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    progress: bool | None = None,
    *,
    durable: bool = True,
) -> list[str]:
    """Writes `state_dict` as (sharded) weights into `save_directory`; returns the files written.

    Every file is written under a temporary name first; then they are published together through a journal
    (`.accel-publish.json`: renames, or swaps with the files they replace, the index last; then removal of the
    indexes of an earlier save that this one does not overwrite, in either format), so a process killed at any
    moment leaves the previous checkpoint or the new one: the next save replays an interrupted journal (a load
    reads the new checkpoint through it; see checkpoint_files).
    The replaced files and the earlier save's other weight files, which nothing names any more, are unlinked before
    it returns, and their blocks freed in the background (accel.checkpoint.background.unlink_now_free_later:
    freeing is what costs ~30 ms per 100 MiB; nothing in the folder changes after the call). The folder's lock
    (accel.checkpoint.target_lock) is held throughout, so a second writer waits. `durable`: fsync every file
    and the folder before returning; without it the files are complete in the page cache (a kill cannot lose
    them, a power loss can) and `sync_files` makes them durable later. `progress`: see accel.checkpoint.progress.
    """
    folder = os.fspath(save_directory)
    if os.path.isfile(folder):
        raise ValueError(f"save_directory '{folder}' is a file, expected a folder")
    os.makedirs(folder, exist_ok=True)
    with TargetLock.acquire(folder, wait_limit().total_seconds()):  # one writer at a time: journals never interleave
        return _save_state_dict_locked(state_dict, folder, max_shard_size, safe_serialization, progress, durable)


def _save_state_dict_locked(
    state_dict: Mapping[str, torch.Tensor],
    folder: str,
    max_shard_size: int | str,
    safe_serialization: bool,
    progress: bool | None,
    durable: bool,
) -> list[str]:
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
                staged.append(
                    (_write_shard(shard, os.path.join(folder, filename), safe_serialization, durable), filename)
                )
                bar.update(sum(t.numel() * t.element_size() for t in shard.values()))
        if len(shards) > 1:
            index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
            index = {
                "metadata": {"total_size": total},
                "weight_map": {name: filename for filename, names in shards.items() for name in names},
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            staged.append(
                (
                    write_temporary(os.path.join(folder, index_name), lambda f: f.write(text), "w", durable=durable),
                    index_name,
                )
            )
        new = {name for _, name in staged}
        stale = [name for name in os.listdir(folder) if WEIGHT_FILE.fullmatch(name) and name not in new]
    except BaseException:
        for temporary, _ in staged:
            remove_quietly(temporary)
        raise
    # Once its journal is written, the publish is decided: an interruption from here on is completed by a replay.
    remove_now_free_later(publish_entries(folder, staged, stale, durable))
    remove_orphan_temporaries(folder)
    return [os.path.join(folder, name) for _, name in staged]


def _write_shard(shard: dict[str, torch.Tensor], path: str, safe_serialization: bool, durable: bool) -> str:
    if safe_serialization:
        return write_temporary_safetensors(shard, path, metadata={"format": "pt"}, durable=durable)
    tensors = {name: t.contiguous().cpu() for name, t in shard.items()}
    return write_temporary(path, lambda f: torch.save(tensors, f), durable=durable)


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


def save_model_files(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    max_shard_size: int | str,
    safe_serialization: bool,
    mode: SaveMode,
) -> None:
    """`Accelerator.save_model` in the three save modes (accel.checkpoint.background): the files complete when it
    returns and durable in the background (default), durable when it returns, or written in the background from
    a snapshot (asynchronous; the worker writes it durably, then publishes). An earlier asynchronous save is joined
    (and its failure raised) first."""
    background.saves.join(asynchronous_only=True)
    folder = os.fspath(save_directory)
    if mode.asynchronous:
        state = snapshot.buffers.take(without_shared_tensors(state_dict))

        write = functools.partial(
            save_state_dict, state, folder, max_shard_size, safe_serialization, progress=False, durable=True
        )
        background.saves.submit(write, f"save_model into '{folder}'", asynchronous=True)
        return
    written = save_state_dict(state_dict, folder, max_shard_size, safe_serialization, durable=mode.durable)
    if not mode.durable:
        background.saves.submit(lambda: sync_files(written), f"fsync of '{folder}'")


_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


# --- loading -------------------------------------------------------------------------------------------------------


def checkpoint_files(checkpoint: str | os.PathLike) -> list[str]:
    """The weight files of `checkpoint`: one file, the files an index names, or what a folder holds. Reads only.

    A folder holding the journal of an interrupted save_model (see PublishJournal) is read as the new checkpoint
    the journal decided, each file wherever it is now (at its temporary name or its final one), never as the mix of
    old and new files the folder holds meanwhile; the folder itself is left as it is, and the writer's next save
    into it completes the publish. Replaying the journal here instead would make a load write into a folder it may
    not own: any model folder from elsewhere can carry a journal. A journal whose files cannot all be found raises
    CheckpointError, as does one accel did not write (it is never acted on).

    An index's shards must be in its folder or below (see `_shard_names`)."""
    path = os.fspath(checkpoint)
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    journal = PublishJournal.read(folder)
    located = {} if journal is None else journal.locate()
    if not os.path.isdir(path):
        return _files_of(path, located)
    candidates = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)
    # With a journal, the new checkpoint is what it publishes: the folder may still hold the old one's index.
    present = located if journal is not None else [n for n in candidates if os.path.isfile(os.path.join(path, n))]
    for name in candidates:
        if name in present:
            return _files_of(os.path.join(path, name), located)
    raise FileNotFoundError(f"'{path}' holds no {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or index of either")


def _files_of(path: str, located: dict[str, str]) -> list[str]:
    """The weight files of the file `path` (itself, or the shards it indexes); `located`: where the files of an
    interrupted publish in its folder are now, by final name."""
    folder, name = os.path.split(path)
    actual = located.get(name, path)
    if not os.path.isfile(actual):
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    if not path.endswith(".json"):
        return [actual]
    files = [located.get(shard, os.path.join(folder, shard)) for shard in _shard_names(path, actual)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(f"'{path}' names shards that do not exist: {', '.join(missing)}")
    return files


def is_safetensors(path: str) -> bool:
    """Whether the weight file `path` (from checkpoint_files) is safetensors, by its name: a file an interrupted
    publish left at its temporary name is told by the final name in it."""
    name = os.path.basename(path)
    temporary = TEMPORARY_NAME.fullmatch(name)
    return (temporary["name"] if temporary else name).endswith(".safetensors")


def _shard_names(index: str, actual: str) -> list[str]:
    """The shard files the checkpoint index `index` (read from `actual`) names, relative to its folder.

    Each must stay inside that folder (or a folder below it): a relative path without '..'. As transformers
    checks the names rather than resolving them: shards in the Hub's cache are symbolic links to `../../blobs`, and
    a folder's own links are its owner's choice."""
    try:
        with open(actual, "rb") as f:
            weight_map = json.loads(f.read())["weight_map"]
    except (ValueError, RecursionError, KeyError, TypeError) as error:
        raise CheckpointError(f"'{index}' is not a checkpoint index (no weight_map): {error}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise CheckpointError(f"'{index}': weight_map must map tensor names to file names")
    for tensor, shard in weight_map.items():
        if not shard or "\0" in shard or os.path.isabs(shard) or ".." in shard.split(os.sep):
            raise CheckpointError(
                f"'{index}': weight_map entry '{tensor}' names {shard!r}, not a file inside the "
                "index's folder (a shard is named relative to it, without '..')"
            )
    return list(dict.fromkeys(weight_map.values()))


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
    accel.checkpoint.progress. Nothing on disk changes: a folder whose save_model was interrupted is read as the
    new checkpoint, and the next save into it completes the publish (see checkpoint_files).
    """
    if device_map is not None or offload_folder is not None or offload_state_dict or offload_buffers:
        raise NotImplementedError(
            "device_map and offloading in load_checkpoint_in_model are not supported by accel "
            "yet (big-model inference); load on the model's own devices (device_map=None)"
        )
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
    missing = [
        name for name in destinations if name not in found and _memory_key(destinations[name]) not in loaded_memory
    ]
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
    if is_safetensors(path):
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
                    raise CheckpointError(
                        f"'{path}', tensor '{name}': the checkpoint has shape {list(tensor.shape)}, "
                        f"the destination {list(destinations[name].shape)}"
                    )
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
