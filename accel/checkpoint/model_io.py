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

import dataclasses
import functools
import json
import logging
import os
import re
import stat
from collections.abc import Mapping

import torch

from accel.checkpoint import background, snapshot
from accel.checkpoint.atomic_files import (
    TEMPORARY_NAME,
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
from accel.checkpoint.safetensors_io import CheckpointError, FileIdentity, SafetensorsFile, _is_int, _shown
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
    removes the indexes named in `remove`, as one step: through a journal (`PublishJournal`) that the writer's next
    save completes after a kill and that a reader reads the new files through (see save_state_dict).

    An existing file is swapped with its replacement (renameat2 RENAME_EXCHANGE: cheaper than a rename over it)
    and left at the temporary name. Returns what is left to remove (those old files, the stale shards in
    `remove`): nothing reads them any more, so the caller removes them after (`unlink_now_free_later`)."""
    journal = PublishJournal.plan(folder, renames, remove)
    try:
        write_atomically(journal.path, lambda f: f.write(journal.to_json()), mode="w", durable=durable)
    except BaseException:
        for temporary, _ in renames:
            remove_quietly(temporary)
        raise
    leftovers = journal.move_into_place()
    for name in remove:
        if name.endswith(".index.json"):  # no index may name a shard once its own shards are gone
            remove_quietly(os.path.join(folder, name))
    if durable:
        fsync_directory(folder)
    remove_quietly(journal.path)
    return leftovers + [os.path.join(folder, name) for name in remove if not name.endswith(".index.json")]


def replay_journal(folder: str) -> None:
    """Completes the publish a killed save left in `folder` (its journal), if any: the writer's side only (a save
    into the folder does this first); a load never changes the folder (see checkpoint_files).

    A journal that names anything but accel's own entries of the folder is refused (CheckpointError) and left as it
    is (see PublishJournal.read); only files the journal proves are the save's own are moved or removed."""
    journal = PublishJournal.read(folder)
    if journal is None:
        return
    background.unlink_now_free_later(journal.move_into_place() + journal.stale_files())
    remove_quietly(journal.path)


def _identity_at(path: str) -> FileIdentity | None:
    """The identity of the entry at `path` itself (a symbolic link's own: never followed); None if nothing is there."""
    info = _lstat_or_none(path)
    return None if info is None else FileIdentity.of(info)


def _lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class _Rename:
    temporary: str  # a name in the journal's folder, where the new file was written
    name: str  # its final name there
    file: FileIdentity  # the new file
    replaces: FileIdentity | None  # the file at `name` when the journal was written, if any


@dataclasses.dataclass(frozen=True)
class PublishJournal:
    """A save_model's plan to publish its files (`.accel-publish.json` in the folder), written once every new file
    is complete at its temporary name: from then on the new checkpoint is decided, and its files move into place.

    Every file is recorded with its identity (device, inode, size, mtime: a rename keeps them), so that what is
    done can be told from the folder alone: a temporary name holding the new file is still to be moved; one holding
    the file it replaced was swapped already. Anything else found there is not the save's to move or remove."""

    folder: str
    renames: tuple[_Rename, ...]
    stale: tuple[tuple[str, FileIdentity], ...]  # earlier weight files to remove (name, identity)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, PUBLISH_JOURNAL)

    @classmethod
    def plan(cls, folder: str, renames: list[tuple[str, str]], remove: list[str]) -> PublishJournal:
        moves = tuple(
            _Rename(
                os.path.basename(temporary),
                name,
                FileIdentity.of(os.lstat(temporary)),
                _identity_at(os.path.join(folder, name)),
            )
            for temporary, name in renames
        )
        stale = tuple(
            (name, identity) for name in remove if (identity := _identity_at(os.path.join(folder, name))) is not None
        )
        return cls(folder, moves, stale)

    def to_json(self) -> str:
        return json.dumps(
            {
                "rename": [
                    {
                        "temporary": r.temporary,
                        "name": r.name,
                        "file": list(dataclasses.astuple(r.file)),
                        "replaces": None if r.replaces is None else list(dataclasses.astuple(r.replaces)),
                    }
                    for r in self.renames
                ],
                "remove": [
                    {"name": name, "file": list(dataclasses.astuple(identity))} for name, identity in self.stale
                ],
            }
        )

    @classmethod
    def read(cls, folder: str) -> PublishJournal | None:
        """The journal of `folder`, validated; None when there is none. Changes nothing.

        Raises CheckpointError, naming the journal and the entry, unless it is a journal accel wrote: every name in
        it a plain entry of the folder (a weight file name, or a temporary name accel gives that file: no
        separator, no '..', never absolute), and every entry it names that exists a regular file (not a symbolic
        link). A model folder from elsewhere can hold any dotfile; one that names other files is never acted on."""
        path = os.path.join(folder, PUBLISH_JOURNAL)
        text = _read_journal_text(path)
        if text is None:
            return None
        try:
            plan = json.loads(text)
        except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deeply
            raise _refused(path, f"it is not JSON ({error})") from None
        if not (
            isinstance(plan, dict)
            and set(plan) == {"rename", "remove"}
            and isinstance(plan["rename"], list)
            and isinstance(plan["remove"], list)
        ):
            raise _refused(path, "expected an object of two lists, 'rename' and 'remove'")
        journal = cls(
            folder,
            tuple(_rename_entry(path, i, entry) for i, entry in enumerate(plan["rename"])),
            tuple(_stale_entry(path, i, entry) for i, entry in enumerate(plan["remove"])),
        )
        for name in [n for r in journal.renames for n in (r.temporary, r.name)] + [n for n, _ in journal.stale]:
            info = _lstat_or_none(os.path.join(folder, name))
            if info is not None and not stat.S_ISREG(info.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                raise _refused(path, f"it names '{name}', which is {kind}")
        return journal

    def locate(self) -> dict[str, str]:
        """{final name: the path of its new file now}, without changing anything: at the temporary name until it
        is moved, then at its name. Raises CheckpointError when a new file is in neither place."""
        located = {}
        for r in self.renames:
            places = [os.path.join(self.folder, r.temporary), os.path.join(self.folder, r.name)]
            found = [place for place in places if _identity_at(place) == r.file]
            if not found:
                raise CheckpointError(
                    f"a save into '{self.folder}' was interrupted while publishing its files, and its new '{r.name}' "
                    f"is neither at '{r.temporary}' nor at '{r.name}' any more (the folder changed since, or a save "
                    f"into it is running now): load it once that save is done, or save the model into '{self.folder}' "
                    f"again. The journal '{self.path}' was left as it is"
                )
            located[r.name] = found[0]
        return located

    def move_into_place(self) -> list[str]:
        """Renames (or swaps) each new file into place unless done already. Returns the replaced files left at
        temporary names (by a swap now, or before a kill), for the caller to remove; any other file found at a
        temporary name is left alone."""
        leftovers = []
        for r in self.renames:
            source, target = os.path.join(self.folder, r.temporary), os.path.join(self.folder, r.name)
            found = _identity_at(source)
            if found == r.file:
                if not (os.path.lexists(target) and exchange(source, target)):
                    os.replace(source, target)
                    continue
                found = _identity_at(source)  # what the swap displaced
            if found is not None and found == r.replaces:
                leftovers.append(source)
            elif found is not None:
                logger.warning(
                    "leaving '%s' alone: the publish journal of '%s' names it, but it holds neither the "
                    "new '%s' nor the file that one replaced",
                    source,
                    self.folder,
                    r.name,
                )
        return leftovers

    def stale_files(self) -> list[str]:
        """The earlier weight files to remove that are still the ones the journal recorded."""
        paths = [os.path.join(self.folder, name) for name, _ in self.stale]
        return [path for path, (_, identity) in zip(paths, self.stale) if _identity_at(path) == identity]


def _read_journal_text(path: str) -> bytes | None:
    """The bytes of the journal at `path` (None when there is none), read without following a symbolic link or
    blocking on a FIFO planted under its name."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a symbolic link
        raise _refused(path, f"it cannot be opened as a file: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_JOURNAL_BYTES:
            raise _refused(path, f"it is not a regular file of at most {_MAX_JOURNAL_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(_MAX_JOURNAL_BYTES + 1)
    finally:
        os.close(fd)


_MAX_JOURNAL_BYTES = 64 << 20  # a few hundred bytes per file of the checkpoint


def _refused(path: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"refusing the publish journal '{path}': {why}. accel acts only on a journal it wrote, "
        "which names regular files of its own folder (weight files and accel's temporary names "
        "for them); nothing was touched. If the folder is yours, check its files and remove the "
        "journal"
    )


def _rename_entry(path: str, i: int, entry: object) -> _Rename:
    if not isinstance(entry, dict) or set(entry) != {"temporary", "name", "file", "replaces"}:
        raise _refused(
            path, f"rename entry {i}, {_shown(entry, 300)}, is not an object of temporary, name, file, replaces"
        )
    temporary, name = entry["temporary"], entry["name"]
    if not (isinstance(name, str) and _WEIGHT_FILE.fullmatch(name)):
        raise _refused(path, f"rename entry {i} names {_shown(name, 300)}, not a weight file name")
    match = TEMPORARY_NAME.fullmatch(temporary) if isinstance(temporary, str) else None
    if match is None or match["name"] != name:
        raise _refused(
            path, f"rename entry {i} names {_shown(temporary, 300)}, not a temporary name accel gives '{name}'"
        )
    replaces = None if entry["replaces"] is None else _identity_entry(path, f"rename entry {i}", entry["replaces"])
    return _Rename(temporary, name, _identity_entry(path, f"rename entry {i}", entry["file"]), replaces)


def _stale_entry(path: str, i: int, entry: object) -> tuple[str, FileIdentity]:
    if not isinstance(entry, dict) or set(entry) != {"name", "file"}:
        raise _refused(path, f"remove entry {i}, {_shown(entry, 300)}, is not an object of name and file")
    if not (isinstance(entry["name"], str) and _WEIGHT_FILE.fullmatch(entry["name"])):
        raise _refused(path, f"remove entry {i} names {_shown(entry['name'], 300)}, not a weight file name")
    return entry["name"], _identity_entry(path, f"remove entry {i}", entry["file"])


def _identity_entry(path: str, where: str, value: object) -> FileIdentity:
    if not (isinstance(value, list) and len(value) == 4 and all(_is_int(v) and v >= 0 for v in value)):
        raise _refused(path, f"{where}: a file's identity is four non-negative integers, got {_shown(value)}")
    return FileIdentity(*value)


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


def _remove_orphan_temporaries(folder: str) -> None:
    """The temporary weight files of saves killed midway (their process is gone): regular files at names accel gives
    them (`TEMPORARY_NAME`); a symbolic link or anything else at such a name is not accel's and stays."""
    with os.scandir(folder) as entries:
        for entry in entries:
            match = TEMPORARY_NAME.fullmatch(entry.name)
            if (
                match
                and _WEIGHT_FILE.fullmatch(match["name"])
                and entry.is_file(follow_symlinks=False)
                and not process_alive(int(match["pid"]))
            ):
                remove_quietly(entry.path)


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
