"""The durability of a published checkpoint: its record (`.accel-durability`) says whether everything in the folder
is on disk ("durable"), or was published from the page cache during this boot ("unsynced" with the boot's id),
and what a save or a load does about it. accel.checkpoint.background runs `Durability.complete` after a
default-mode save; a load of the newest checkpoint asks `durability_of` (see its module docstring for the modes).
"""

from __future__ import annotations

import os
import socket
import stat

from accel.checkpoint.atomic_files import create_exclusive, fsync_directory
from accel.checkpoint.names import DURABILITY_RECORD


def boot_identity() -> str:
    """This machine and this boot of it: data in the page cache survives a process kill, not a restart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()} {boot}"


class Durability:
    """A save_state folder on its way to durable, through its durability record (`.accel-durability`).

    `start` creates the record ("unsynced <host> <boot>") in a folder about to be published; `complete` fsyncs
    every entry of the folder, the folder and its parent, then rewrites the record's content to "durable <host>
    <boot>" and fsyncs it. Both work through descriptors opened while the save still runs (`moved_to` re-opens the
    folder where the publish put the files), never by path later: a folder the user removed, moved or replaced
    meanwhile is never written into, and no directory entry changes (the record is rewritten in place, not
    replaced). The record's content says "durable" only once everything it describes is on disk; a reader that
    meets it half rewritten finds neither word and answers "unknown", which the readers treat as durable (as
    it is by then).
    """

    def __init__(self, folder: str, record_fd: int) -> None:
        self._record_fd: int | None = record_fd
        self._folder_fd: int | None = None
        self._parent = "."
        try:
            self.moved_to(folder)
        except BaseException:
            self.close()
            raise

    @classmethod
    def start(cls, folder: str) -> Durability:
        """Creates the record of `folder` (which must not have one yet) saying "unsynced" with this boot's id."""
        fd = create_exclusive(os.path.join(folder, DURABILITY_RECORD))
        try:
            os.write(fd, f"unsynced {boot_identity()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        return cls(folder, fd)

    @classmethod
    def resume(cls, folder: str) -> Durability | None:
        """The durability of `folder` published earlier (its record there), or None when it has no record."""
        try:
            fd = os.open(os.path.join(folder, DURABILITY_RECORD), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return cls(folder, fd)

    def moved_to(self, folder: str) -> None:
        """Follows the files to `folder`, where publishing put them (opened now, while the save runs)."""
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if self._folder_fd is not None:
            os.close(self._folder_fd)
        self._folder_fd = fd
        self._parent = os.path.dirname(os.path.normpath(folder)) or "."

    def complete(self) -> None:
        """fsyncs the folder's files, the folder and its parent, then records "durable"; closes the descriptors.
        Nothing is done for a folder removed meanwhile."""
        if self._folder_fd is None:  # closed: completed already, or given up
            return
        try:
            try:
                names = os.listdir(self._folder_fd)
            except FileNotFoundError:  # removed meanwhile (rotated out, or by the user): nothing left to keep
                return
            for name in names:
                _fsync_entry(self._folder_fd, name)
            os.fsync(self._folder_fd)
            fsync_directory(self._parent)
            _rewrite(self._record_fd, f"durable {boot_identity()}\n".encode())
        finally:
            self.close()

    def close(self) -> None:
        """Closes the descriptors (idempotent): on a failure before `complete`, or after it."""
        for fd in (self._folder_fd, self._record_fd):
            if fd is not None:
                os.close(fd)
        self._folder_fd = self._record_fd = None


def _fsync_entry(folder_fd: int, name: str) -> None:
    """fsyncs a file of the folder, or a folder in it with everything below it (FSDP's DCP folders)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd)
    except (FileNotFoundError, OSError):  # removed meanwhile, or a link: not ours to sync
        return
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            for child in os.listdir(fd):
                _fsync_entry(fd, child)
        os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite(fd: int, content: bytes) -> None:
    """Replaces a small file's content in place through `fd`, durably."""
    os.pwrite(fd, content, 0)
    os.ftruncate(fd, len(content))
    os.fsync(fd)


def sync_published(folder: str) -> None:
    """fsyncs, now, a folder published earlier in the default mode (its files, itself, its parent) without touching
    its record: what a load does for a checkpoint whose writer has not finished that (a load changes nothing on
    disk; the record stays the writer's to complete)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        for name in os.listdir(fd):
            _fsync_entry(fd, name)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(os.path.dirname(os.path.normpath(folder)) or ".")


def durability_of(folder: str) -> str:
    """ "durable" (everything fsync'd), "this-boot" (published without fsync during this boot: the page cache still
    holds it), "lost-boot" (published without fsync before the machine restarted: its bytes may be gone), or
    "unknown" (no record, or one accel did not write: written by HF Accelerate or an older accel)."""
    try:
        with open(os.path.join(folder, DURABILITY_RECORD), "rb") as f:
            words = f.read(4096).decode().split()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    if len(words) < 2 or words[0] not in ("durable", "unsynced"):
        return "unknown"
    if words[0] == "durable":
        return "durable"
    return "this-boot" if " ".join(words[1:]) == boot_identity() else "lost-boot"
