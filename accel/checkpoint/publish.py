"""Where a checkpoint folder goes and how it gets there: staged beside its final place, published in one rename,
older numbered checkpoints rotated out, replaced ones discarded.

A save writes into a hidden staging folder next to `NAME`, created exclusively under a name nobody can predict
(`.NAME.partial-PID-RANDOM`, `create_staging`): never reused, so a link or folder planted at a staging name is
never written through. `publish_and_rotate` renames it into place once every file is in it (an existing folder of
that name is swapped out atomically with renameat2(RENAME_EXCHANGE)), so a crash mid-save leaves the previous
checkpoint intact and never a partial one that load_state would pick. Where renameat2 is missing the old folder is
parked at `<staging>.old` between two renames; the writer's next save puts it back after a crash
(`recover_interrupted_publish`), and a load reads it where it is (`readable_folder`): loading never renames. The
writer holds the folder's lock (accel.checkpoint.target_lock) throughout, which is also what makes the staging
folders of dead writers safe to sweep. A folder that holds other things than a checkpoint (logs...) gets its
checkpoint's entries replaced one by one instead, through the journal save_model uses
(accel.checkpoint.publish_journal): a kill midway leaves the previous checkpoint or the new one, the next save
completes it, and a load reads the new one through the journal. With automatic_checkpoint_naming, `rotate`
removes the oldest `checkpoint_N` folders by number beyond total_limit, keeping the newest durable one until the new
one is durable too. Replaced and rotated-out folders are gone before the call returns (`discard`); only freeing
their blocks is left to the background. Durability itself (fsync, the `.accel-durability` record) is
accel.checkpoint.durability.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator

from accel.checkpoint import background
from accel.checkpoint.atomic_files import exchange, fsync_directory, process_alive, remove_quietly, temporary_name
from accel.checkpoint.background import remove_tree_now_free_later
from accel.checkpoint.durability import Durability, durability_of
from accel.checkpoint.names import CHECKPOINT_FILE, CHECKPOINT_PATTERN, DURABILITY_RECORD
from accel.checkpoint.publish_journal import (
    journal_view,
    publish_entries,
    remove_now_free_later,
    remove_orphan_temporaries,
    replay_journal,
)

logger = logging.getLogger(__name__)


def checkpoint_number(folder: str) -> int | None:
    match = CHECKPOINT_PATTERN.fullmatch(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else None


def numbered_checkpoints(root: str) -> list[str]:
    """The `checkpoint_N` folders under `root`, oldest (lowest N) first; anything else there is ignored."""
    if not os.path.isdir(root):
        return []
    folders = [os.path.join(root, name) for name in os.listdir(root) if checkpoint_number(name) is not None]
    return sorted((f for f in folders if os.path.isdir(f)), key=checkpoint_number)


def create_staging(final: str) -> str:
    """Creates the hidden staging folder of a save into `final`, next to it, and returns its path. The name is new
    (this pid and 64 random bits) and mkdir creates it exclusively: a name someone planted (a link, a folder) makes
    it fail instead of being used."""
    folder, name = os.path.split(os.path.normpath(final))
    staging = os.path.join(folder, f".{name}.partial-{os.getpid()}-{secrets.token_hex(8)}")
    os.makedirs(folder or ".", exist_ok=True)
    os.mkdir(staging)
    return staging


def _staging_pattern(final: str, parked: bool) -> re.Pattern:
    """The staging folders of `final` (with `parked`: the previous checkpoint parked by publish's fallback), in
    this version's names and the fixed ones older versions used (`.NAME.partial`, `.NAME.partial-node<K>`)."""
    name = re.escape(f".{os.path.basename(os.path.normpath(final))}.partial")
    return re.compile(name + r"(-\d+-[0-9a-f]{16}|-node\d+)?" + (r"\.old" if parked else ""))


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

    When `final` holds other things than a checkpoint (see foreign_entries), they are kept: the new entries are
    published into it through a journal instead (`_publish_among_other_entries`). `durable`: fsync the folders
    (else accel.checkpoint.durability.Durability does it later).
    """
    sync = fsync_directory if durable else (lambda folder: None)
    sync(partial)  # every entry of the folder is durable before it is renamed into place
    foreign = foreign_entries(final, partial)
    if foreign:
        logger.warning(
            "'%s' holds other things than a checkpoint (%s): replacing its checkpoint's entries one by one, "
            "through a journal, so that they are kept",
            final,
            ", ".join(foreign[:5]),
        )
        _publish_among_other_entries(partial, final, durable)
    elif not os.path.exists(final):
        os.rename(partial, final)
    elif exchange(partial, final):
        discard(partial)  # now the previous checkpoint
    else:  # no renameat2 here: two renames, with the old folder kept until the new one is in place
        old = partial + ".old"  # a new name, as the staging folder's is
        os.rename(final, old)
        os.rename(partial, final)
        discard(old)
    sync(os.path.dirname(os.path.normpath(final)) or ".")


def parked_checkpoint(final: str) -> str | None:
    """The previous checkpoint of `final` that a crash between the two renames of publish's fallback left parked
    at `<staging>.old` while nothing is at `final`, else None."""
    if os.path.lexists(final):
        return None
    parent = os.path.dirname(os.path.normpath(final)) or "."
    parked = _staging_pattern(final, parked=True)
    for candidate in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        old = os.path.join(parent, candidate)
        if parked.fullmatch(candidate) and os.path.isdir(old) and not os.path.islink(old):
            return old
    return None


def recover_interrupted_publish(final: str) -> None:
    """The writer's side of `parked_checkpoint`: puts the parked previous checkpoint back at `final`."""
    old = parked_checkpoint(final)
    if old is not None:
        logger.warning("restoring '%s' from '%s' (a save was interrupted)", final, old)
        os.rename(old, final)


@contextlib.contextmanager
def readable_folder(folder: str) -> Iterator[str]:
    """Where a load finds the checkpoint of `folder`: the folder itself; after a crash between the two renames of
    publish's fallback, the previous checkpoint where it is parked; after a crash while publishing into a folder
    that holds other things, a private view of the checkpoint its journal published (`journal_view`, removed on
    exit). A load renames nothing: the writer's next save puts things back."""
    old = parked_checkpoint(folder)
    if old is not None:
        logger.warning(
            "'%s' is missing after an interrupted save: loading the previous checkpoint from '%s'", folder, old
        )
        yield old
        return
    if not os.path.isdir(folder):
        yield folder
        return
    with journal_view(folder) as view:
        yield view


def sweep_orphan_staging(final: str) -> None:
    """Removes the staging folders that writers of `final` which died midway left next to it (current names only:
    a fixed old-style name may be a planted link and is left alone). Only the holder of `final`'s lock calls it:
    every live writer of `final` holds that lock, so no staging folder there is in use."""
    parent = os.path.dirname(os.path.normpath(final)) or "."
    staging = _staging_pattern(final, parked=False)
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        match = staging.fullmatch(name)
        if match and match.group(1) and not match.group(1).startswith("-node") and not os.path.islink(path):
            discard(path)


def prepare_staging(output_dir: str, staged: bool) -> str:
    """The writer's preparation of a save into `output_dir` (it holds the folder's lock): recovers an interrupted
    publish, sweeps what dead writers left, and returns the new staging folder (`output_dir` itself when the save
    is written in place, not staged)."""
    recover_interrupted_publish(output_dir)
    if os.path.isdir(output_dir):  # a publish into a folder holding other things, killed midway
        replay_journal(output_dir)
        remove_orphan_temporaries(output_dir)
    sweep_discarded(os.path.dirname(os.path.normpath(output_dir)) or ".")
    if staged:
        sweep_orphan_staging(output_dir)
        return create_staging(output_dir)
    # Written in place: the record of the checkpoint being overwritten no longer holds.
    os.makedirs(output_dir, exist_ok=True)
    remove_quietly(os.path.join(output_dir, DURABILITY_RECORD))
    return output_dir


def _publish_among_other_entries(partial: str, final: str, durable: bool) -> None:
    """Publishes the entries of the complete `partial` into `final`, which holds other things: each moved to a
    temporary name in `final` (the durability record first), then all swapped into place through a journal
    (accel.checkpoint.publish_journal.publish_entries), the previous checkpoint's entries the new one lacks
    (another process count's RNG files, ...) removed with it. A failure before the journal is written leaves the
    previous checkpoint whole: the entries moved so far go back to `partial` (which the caller's failure path
    sweeps), or, once all are moved, are removed (publish_entries)."""
    names = sorted(os.listdir(partial), key=lambda name: name != DURABILITY_RECORD)
    renames: list[tuple[str, str]] = []
    try:
        for name in names:
            temporary = temporary_name(os.path.join(final, name))
            os.rename(os.path.join(partial, name), temporary)
            renames.append((temporary, name))
    except BaseException:
        for temporary, name in renames:
            os.rename(temporary, os.path.join(partial, name))
        raise
    new = set(names)
    stale = [name for name in os.listdir(final) if CHECKPOINT_FILE.fullmatch(name) and name not in new]
    remove_now_free_later(publish_entries(final, renames, stale, durable))
    os.rmdir(partial)


def publish_and_rotate(
    staging: str | None, output_dir: str, root: str | None, total_limit: int | None, durable: bool
) -> None:
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
