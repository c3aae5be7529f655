"""One writer at a time per checkpoint folder: an advisory lock (flock) on a hidden file beside the folder.

Two jobs (or two threads) saving into one folder would otherwise interleave their staging, publishing and cleanup,
and could publish one job's model with the other's optimizer. A save takes the folder's lock before it stages
anything and releases it once the checkpoint is published (an asynchronous save does both on the worker: its call
does not wait for another writer), so every checkpoint that appears is wholly one writer's. A second writer waits
for the first, up to a deadline, then fails naming it (pid and host, recorded in the lock file). The lock dies with
its process (flock), and the file is removed on release: nothing is left beside the folder. Holding the lock is also
what makes the leftovers of dead writers safe to sweep (accel.checkpoint.publish.sweep_orphan_staging): nobody else
is staging.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time

logger = logging.getLogger(__name__)

# Waits between two tries: short at first (a save of small files takes milliseconds), then capped.
_FIRST_WAIT_S = 0.001
_LONGEST_WAIT_S = 0.1


class WriterBusyError(TimeoutError):
    """Another process kept a checkpoint folder's lock longer than the deadline."""


def lock_path(target: str) -> str:
    """The lock file of the checkpoint folder `target`: `.NAME.lock` beside it, or inside it when its parent is not
    writable (a mount point) and the folder exists."""
    # The folder's real path: save_model and save_state share one journal, so a folder reached through a link and
    # by its own path must take one lock.
    parent, name = os.path.split(os.path.realpath(target))
    parent = parent or "."
    if os.path.isdir(target) and not os.access(parent, os.W_OK | os.X_OK):
        return os.path.join(target, ".accel-save.lock")
    return os.path.join(parent, f".{name}.lock")


class TargetLock:
    """The held lock of one checkpoint folder (`acquire`); `release` (or leaving the `with` block) gives it up."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, target: str, timeout_s: float) -> TargetLock:
        """Waits until no other writer holds `target`'s lock (at most `timeout_s`), then holds it.

        Raises:
            WriterBusyError: another writer held it for `timeout_s`; the message names it.
        """
        path = lock_path(target)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        deadline = time.monotonic() + timeout_s
        wait = _FIRST_WAIT_S
        told = False
        while True:
            fd = _open_lock_file(path)
            if _try_lock(fd) and _still_the_file_at(path, fd):
                _record_holder(fd)
                return cls(path, fd)
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise WriterBusyError(
                    f"'{target}' is being saved by another process ({holder}) and it did not finish "
                    f"within {timeout_s:g} s; two jobs must not save into one folder"
                )
            if not told and holder:
                logger.warning("waiting for another process (%s) to finish saving into '%s'", holder, target)
                told = True
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(wait * 2, _LONGEST_WAIT_S)

    def release(self) -> None:
        """Removes the lock file, then unlocks (idempotent). Removing it while still holding the lock is safe: a
        writer that opened the old file finds, once it gets the lock, that the name no longer leads to it, and
        opens anew."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _still_the_file_at(self.path, fd):
                os.unlink(self.path)
        except OSError as error:  # the folder is gone or read-only now: the lock still ends with the descriptor
            logger.debug("could not remove the lock file '%s': %s", self.path, error)
        finally:
            os.close(fd)

    def __enter__(self) -> TargetLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _open_lock_file(path: str) -> int:
    # O_NOFOLLOW: a link planted at the name is refused rather than followed.
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(error.errno, f"'{path}' (a checkpoint lock file) is a symbolic link; remove it") from None
        raise


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _still_the_file_at(path: str, fd: int) -> bool:
    """Whether `path` still names the file open at `fd` (its holder may have removed it on release meanwhile)."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _record_holder(fd: int) -> None:
    record = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder recorded it ("" when it has not written it yet)."""
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""
