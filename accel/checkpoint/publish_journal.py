"""One way to publish a set of new entries into a folder that holds other things too: through a journal.

`save_model` writes its weight files at temporary names in their folder; `save_state` into a folder that also holds
the user's files (logs, other runs' folders: a folder swap would delete them) moves its staged entries there at
temporary names. Either then writes the journal (`.accel-publish.json`, `PublishJournal`): from then on the new
checkpoint is decided, and its entries (files, or folders such as FSDP's sharded state) are swapped into place one
by one, and the entries of the previous checkpoint it no longer has are removed. A save killed at any moment leaves
the previous checkpoint or the new one:
- the writer's next save into the folder completes an interrupted publish first (`replay_journal`);
- a load reads the new checkpoint through the journal, changing nothing: `PublishJournal.locate` for save_model's
  loaders, and for `load_state`, whose readers (user hooks, DCP, DeepSpeed) open paths themselves, a private folder
  of links to where each entry is now (`journal_view`).
A journal is acted on only when accel could have written it: every name in it a plain entry of its own folder,
every entry it names a regular file or a folder (never a link), and removals limited to checkpoint file names; a
model folder from elsewhere can carry any dotfile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

from accel.checkpoint import background
from accel.checkpoint.atomic_files import (
    TEMPORARY_NAME,
    exchange,
    fsync_directory,
    process_alive,
    remove_quietly,
    temporary_name,
    write_atomically,
)
from accel.checkpoint.names import CHECKPOINT_FILE, DURABILITY_RECORD, PUBLISH_JOURNAL, WEIGHT_FILE
from accel.checkpoint.safetensors_io import CheckpointError, FileIdentity, _is_int, _shown

logger = logging.getLogger(__name__)


def removable(name: str) -> bool:
    """Whether a journal may remove the entry `name` of its folder: a weight file or index of save_model, or an
    entry save_state writes."""
    return bool(WEIGHT_FILE.fullmatch(name) or CHECKPOINT_FILE.fullmatch(name))


def publish_entries(folder: str, renames: list[tuple[str, str]], remove: list[str], durable: bool) -> list[str]:
    """Moves the complete entries at temporary names `renames` ((temporary path, final name), in order) into
    place and removes the previous checkpoint's entries named in `remove`, as one step: through a journal
    (`PublishJournal`) that the writer's next save completes after a kill and that a reader reads the new entries
    through. A failure before the journal is written removes the new entries (the previous checkpoint is whole).

    An existing entry is swapped with its replacement (renameat2 RENAME_EXCHANGE: cheaper than a rename over a
    file, and the one atomic way to put a folder over another) and left at the temporary name. Returns those
    replaced entries: nothing reads them (a temporary name), so the caller removes them after the call
    (`remove_now_free_later`)."""
    try:
        journal = PublishJournal.plan(folder, renames, remove)
        write_atomically(journal.path, lambda f: f.write(journal.to_json()), mode="w", durable=durable)
    except BaseException:
        remove_now_free_later([temporary for temporary, _ in renames])
        raise
    leftovers = journal.move_into_place()
    # Before the journal goes: a kill after it must not leave the previous checkpoint's extra entries (an index, a
    # model.safetensors beside a new pytorch_model.bin, other RNG files) among the new ones.
    remove_now_free_later(journal.stale_files())
    if durable:
        fsync_directory(folder)
    remove_quietly(journal.path)
    return leftovers


def replay_journal(folder: str) -> None:
    """Completes the publish a killed save left in `folder` (its journal), if any: the writer's side only (a save
    into the folder does this first, holding its lock); a load never changes the folder.

    A journal that names anything but accel's own entries of the folder is refused (CheckpointError) and left as it
    is (see PublishJournal.read); only files the journal proves are the save's own are moved or removed."""
    journal = PublishJournal.read(folder)
    if journal is None:
        return
    remove_now_free_later(journal.move_into_place() + journal.stale_files())
    remove_quietly(journal.path)


def _identity_at(path: str) -> FileIdentity | None:
    """The identity of the entry at `path` itself (a symbolic link's own: never followed); None if nothing is there.
    A folder is told by its device and inode alone (moving it into another folder rewrites its '..' entry), and so
    is a durability record, which is rewritten in place by design (accel.checkpoint.durability), possibly by the
    background completion of the previous save while this one publishes."""
    info = _lstat_or_none(path)
    if info is None:
        return None
    if stat.S_ISDIR(info.st_mode) or _entry_name(os.path.basename(path)) == DURABILITY_RECORD:
        return FileIdentity(info.st_dev, info.st_ino, 0, 0)
    return FileIdentity.of(info)


def _entry_name(name: str) -> str:
    """The entry a (possibly temporary) name stands for."""
    temporary = TEMPORARY_NAME.fullmatch(name)
    return temporary["name"] if temporary else name


def _lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class _Rename:
    temporary: str  # a name in the journal's folder, where the new entry was put
    name: str  # its final name there
    file: FileIdentity  # the new entry
    replaces: FileIdentity | None  # the entry at `name` when the journal was written, if any


@dataclasses.dataclass(frozen=True)
class PublishJournal:
    """A save's plan to publish its entries (`.accel-publish.json` in the folder), written once every new entry
    is complete at its temporary name: from then on the new checkpoint is decided, and its entries move into place.

    Every entry is recorded with its identity (`_identity_at`: a rename keeps it), so that what is done can be told
    from the folder alone: a temporary name holding the new entry is still to be moved; one holding the entry it
    replaced was swapped already. Anything else found there is not the save's to move or remove."""

    folder: str
    renames: tuple[_Rename, ...]
    stale: tuple[tuple[str, FileIdentity], ...]  # the previous checkpoint's entries to remove (name, identity)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, PUBLISH_JOURNAL)

    @classmethod
    def plan(cls, folder: str, renames: list[tuple[str, str]], remove: list[str]) -> PublishJournal:
        """The journal of publishing `renames` and removing `remove` in `folder`, under `read`'s rules, so that
        it never writes a journal it would refuse: an entry it would replace must be a regular file or a folder
        (ValueError otherwise, before anything is written); one to remove that is not (a user's link named
        `latest`, ...) is left alone."""
        for _, name in renames:
            if not _movable(os.path.join(folder, name)):
                raise ValueError(
                    f"cannot publish '{name}' into '{folder}': the entry there is a symbolic link or neither a file "
                    "nor a folder; accel does not replace it (move it away and save again)"
                )
        remove = [name for name in remove if _movable(os.path.join(folder, name))]
        moves = tuple(
            _Rename(
                os.path.basename(temporary),
                name,
                _identity_at(temporary),
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
        it a plain entry of the folder (an entry's name, or a temporary name accel gives that entry: no separator,
        no '..', never absolute), only checkpoint names to remove (see `removable`), and every entry it names that
        exists a regular file or a folder (not a symbolic link). A model folder from elsewhere can hold any dotfile;
        one that names other entries is never acted on."""
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
        named = [n for r in journal.renames for n in (r.temporary, r.name)] + [n for n, _ in journal.stale]
        repeated = sorted({name for name in named if named.count(name) > 1})
        if repeated:
            raise _refused(path, f"it names '{repeated[0]}' more than once")
        for name in named:
            info = _lstat_or_none(os.path.join(folder, name))
            if info is not None and not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "neither a regular file nor a folder"
                raise _refused(path, f"it names '{name}', which is {kind}")
        return journal

    def locate(self) -> dict[str, str]:
        """{final name: the path of its new entry now}, without changing anything: at the temporary name until it
        is moved, then at its name. Raises CheckpointError when a new entry is in neither place."""
        located = {}
        for r in self.renames:
            places = [os.path.join(self.folder, r.temporary), os.path.join(self.folder, r.name)]
            found = [place for place in places if _identity_at(place) == r.file]
            if not found:
                raise CheckpointError(
                    f"a save into '{self.folder}' was interrupted while publishing its files, and its new '{r.name}' "
                    f"is neither at '{r.temporary}' nor at '{r.name}' any more (the folder changed since, or a save "
                    f"into it is running now): load it once that save is done, or save into '{self.folder}' "
                    f"again. The journal '{self.path}' was left as it is"
                )
            located[r.name] = found[0]
        return located

    def move_into_place(self) -> list[str]:
        """Renames (or swaps) each new entry into place unless done already. Returns the replaced entries left at
        temporary names (by a swap now, or before a kill), for the caller to remove; any other entry found at a
        temporary name is left alone."""
        leftovers = []
        for r in self.renames:
            source, target = os.path.join(self.folder, r.temporary), os.path.join(self.folder, r.name)
            found = _identity_at(source)
            if found == r.file:
                if not os.path.lexists(target):  # nothing there, or a folder renamed aside before a kill
                    os.rename(source, target)
                    continue
                if _identity_at(target) != r.replaces:  # never put the new entry over one the journal did not see
                    raise CheckpointError(
                        f"the publish journal '{self.path}' would replace '{r.name}', but that is no longer the "
                        f"entry it recorded (the folder changed since): nothing more was moved; check '{self.folder}'"
                    )
                if not exchange(source, target):
                    leftovers += _rename_over(source, target)
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
        """The previous checkpoint's entries to remove that are still the ones the journal recorded."""
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
        f"refusing the publish journal '{path}': {why}. accel acts only on a journal it wrote, which names "
        "regular files and folders of its own folder (checkpoint entries and accel's temporary names for them) "
        "once each; nothing was touched. If the folder is yours, fix or move away the entry named: removing the "
        "journal instead keeps whatever mix of two checkpoints the folder holds now"
    )


def _movable(path: str) -> bool:
    """Nothing at `path`, or a regular file or folder (not a symbolic link): what a journal may replace or remove."""
    info = _lstat_or_none(path)
    return info is None or stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)


def _rename_entry(path: str, i: int, entry: object) -> _Rename:
    if not isinstance(entry, dict) or set(entry) != {"temporary", "name", "file", "replaces"}:
        raise _refused(
            path, f"rename entry {i}, {_shown(entry, 300)}, is not an object of temporary, name, file, replaces"
        )
    temporary, name = entry["temporary"], entry["name"]
    if not _plain_name(name):
        raise _refused(path, f"rename entry {i} names {_shown(name, 300)}, not an entry of the folder")
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
    if not (isinstance(entry["name"], str) and removable(entry["name"])):
        raise _refused(path, f"remove entry {i} names {_shown(entry['name'], 300)}, not a checkpoint file name")
    return entry["name"], _identity_entry(path, f"remove entry {i}", entry["file"])


def _identity_entry(path: str, where: str, value: object) -> FileIdentity:
    if not (isinstance(value, list) and len(value) == 4 and all(_is_int(v) and v >= 0 for v in value)):
        raise _refused(path, f"{where}: a file's identity is four non-negative integers, got {_shown(value)}")
    return FileIdentity(*value)


def remove_orphan_temporaries(folder: str) -> None:
    """The temporary entries of saves killed midway (their process is gone): regular files and folders at the
    names accel gives checkpoint entries (`TEMPORARY_NAME` of a `removable` name); a symbolic link or anything else
    at such a name is not accel's and stays."""
    with os.scandir(folder) as entries:
        for entry in entries:
            match = TEMPORARY_NAME.fullmatch(entry.name)
            if (
                match
                and removable(match["name"])
                and (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False))
                and not process_alive(int(match["pid"]))
            ):
                remove_now_free_later([entry.path])


def _rename_over(source: str, target: str) -> list[str]:
    """Puts `source` at the existing `target` without renameat2: a file is renamed over it; a folder (a rename
    cannot replace a non-empty one) after the old one is renamed aside to a temporary name of its own, which is
    returned for removal (a kill in between leaves `target` missing: the journal's replay renames `source` in, and
    the next save's `remove_orphan_temporaries` removes the old folder)."""
    if not (os.path.isdir(target) and not os.path.islink(target)):
        os.replace(source, target)
        return []
    aside = temporary_name(target)
    os.rename(target, aside)
    os.rename(source, target)
    return [aside]


def remove_now_free_later(paths: list[str]) -> None:
    """Removes the files and folders `paths` (those that are there) before returning; the blocks of large files
    are freed in the background."""
    folders = [p for p in paths if os.path.isdir(p) and not os.path.islink(p)]
    background.unlink_now_free_later([p for p in paths if p not in folders])
    for folder in folders:
        background.remove_tree_now_free_later(folder)


def _plain_name(name: object) -> bool:
    """A name of an entry directly in its folder (never the journal's own)."""
    return (
        isinstance(name, str)
        and 0 < len(os.fsencode(name)) <= 255  # a file name's limit, in bytes
        and "/" not in name
        and "\0" not in name
        and name not in (".", "..", PUBLISH_JOURNAL)
    )


@contextlib.contextmanager
def journal_view(folder: str) -> Iterator[str]:
    """The folder to read `folder`'s checkpoint from while it holds the journal of an interrupted publish: a new
    private folder (removed on exit) of symbolic links to where each entry of the new checkpoint is now, and to
    the folder's other entries; `folder` itself when it holds no journal. Changes nothing in `folder`: readers that
    open paths themselves (load hooks, DCP, DeepSpeed) read the new checkpoint, never a mix of the two."""
    journal = PublishJournal.read(folder)
    if journal is None:
        yield folder
        return
    located = journal.locate()
    skipped = {name for name, _ in journal.stale} | {PUBLISH_JOURNAL}
    view = tempfile.mkdtemp(prefix="accel-checkpoint-view-")
    try:
        for name in os.listdir(folder):
            if name not in located and name not in skipped and not TEMPORARY_NAME.fullmatch(name):
                os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(view, name))
        for name, path in located.items():
            os.symlink(os.path.abspath(path), os.path.join(view, name))
        logger.warning(
            "a save into '%s' was interrupted while publishing: reading the checkpoint it published through its "
            "journal (the next save into the folder completes it)",
            folder,
        )
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)
