"""What a save leaves for after it returns: durability (fsync, then a marker) and asynchronous writes.

Three save modes (`SaveMode`), chosen per call or by `ProjectConfiguration(async_save=..., durable_save=...)`:

- default: the call returns once every file is complete at its final name, in the page cache (as HF's save
  does, at the same speed). A process killed at any moment leaves the previous checkpoint or the new one, never
  a mix. Durability against power loss follows in the background: every file and the folder are fsync'd, then
  the marker `.accel-durable` is written into a save_state folder. Until then the folder holds `.accel-unsynced`
  (this machine's boot id): `load_state()` without a path skips a checkpoint that was not made durable before
  the machine restarted, and completes the durability of one from this boot itself.
- durable: the call returns once everything is fsync'd and the marker written (the mode of accel until now).
- async: the call returns after an in-memory snapshot of the state (one extra copy, kept for the next
  asynchronous save); writing, publishing and durability run in the background. The next save, `load_state`,
  `end_training` and `wait_for_checkpoint()` join it, and a failure is raised there.

One worker thread per process runs the jobs in the order they were submitted, and the interpreter waits for it at
exit, so a script that ends right after a save still leaves a durable checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from accel.checkpoint.names import DURABLE_MARKER, UNSYNCED_MARKER
from accel.checkpoint.atomic_files import create_exclusive, fsync_directory

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveMode:
    """How a save trades waiting for safety (see the module docstring)."""

    asynchronous: bool = False
    durable: bool = False

    @classmethod
    def resolve(cls, config: object, async_save: bool | None, durable: bool | None) -> SaveMode:
        """The call's arguments where given, else the ProjectConfiguration's fields."""
        asynchronous = getattr(config, "async_save", False) if async_save is None else async_save
        durable = getattr(config, "durable_save", False) if durable is None else durable
        return cls(bool(asynchronous), bool(durable))


class BackgroundSaves:
    """A FIFO of save jobs on one worker thread; failures are kept until the next join raises them."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._failures: list[BaseException] = []
        self._last_asynchronous: Future | None = None

    def submit(self, job: Callable[[], None], what: str, asynchronous: bool = False) -> Future:
        """Runs `job` after every job submitted before it; `what` names it in logs and errors."""
        with self._lock:
            if self._executor is None:  # its thread is joined at interpreter exit, after the queued jobs ran
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="accel-checkpoint")
            future = self._executor.submit(self._run, job, what)
            self._pending.append(future)
            if asynchronous:
                self._last_asynchronous = future
        return future

    def _run(self, job: Callable[[], None], what: str) -> None:
        try:
            job()
        except BaseException as error:
            logger.error("checkpoint work in the background failed (%s): %s", what, error)
            with self._lock:
                self._failures.append(error)
            raise

    def join(self, asynchronous_only: bool = False) -> None:
        """Waits for the queued jobs (with `asynchronous_only`, until the last asynchronous save is written: the
        durability of default-mode saves may go on), then raises the first failure since the last join."""
        while True:  # a job may queue more (a durability job discards rotated-out checkpoints)
            with self._lock:
                if asynchronous_only:
                    waited = [self._last_asynchronous] if self._last_asynchronous is not None else []
                else:
                    waited = [f for f in self._pending if not f.done()]
            if not waited:
                break
            for future in waited:
                future.exception()  # waits; the failure itself is in self._failures
            if asynchronous_only:
                break
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            if self._last_asynchronous is not None and self._last_asynchronous.done():
                self._last_asynchronous = None
            failures, self._failures = self._failures, []
        if failures:
            raise RuntimeError(f"a checkpoint saved in the background failed: {failures[0]}") from failures[0]

    def busy(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._pending)


saves = BackgroundSaves()


def finish() -> None:
    """The end of training: waits for every save (raising a failure), then frees the asynchronous snapshot."""
    from accel.checkpoint import snapshot

    try:
        saves.join()
    finally:
        snapshot.buffers.release()


# --- durability -----------------------------------------------------------------------------------------------------


def boot_identity() -> str:
    """This machine and this boot of it: data in the page cache survives a process kill, not a restart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()} {boot}"


def mark_unsynced(folder: str) -> None:
    """Records, in a folder about to be published without fsync, the boot whose page cache holds its bytes."""
    fd = create_exclusive(os.path.join(folder, UNSYNCED_MARKER))
    with os.fdopen(fd, "w") as f:
        f.write(boot_identity() + "\n")


def make_durable(folder: str, mark: bool = True) -> None:
    """fsyncs every file of `folder`, the folder and its parent; then (`mark`) writes the durable marker, fsync'd
    too. Works on the folder it opened even if it is renamed meanwhile; a folder removed meanwhile is skipped."""
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        for name in os.listdir(folder_fd):
            _fsync_entry(folder_fd, name)
        os.fsync(folder_fd)
        fsync_directory(os.path.dirname(os.path.normpath(folder)) or ".")
        if mark:
            _write_marker(folder_fd)
    except FileNotFoundError:  # the folder was removed meanwhile (rotated out by a later save): nothing to keep
        pass
    finally:
        os.close(folder_fd)


def _fsync_entry(folder_fd: int, name: str) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd)
    except (FileNotFoundError, OSError):  # removed meanwhile, or a link: not ours to sync
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder_fd: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(DURABLE_MARKER, flags, 0o644, dir_fd=folder_fd)
    try:
        os.write(fd, (boot_identity() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.unlink(UNSYNCED_MARKER, dir_fd=folder_fd)
    except FileNotFoundError:
        pass
    os.fsync(folder_fd)


def durability_of(folder: str) -> str:
    """"durable" (marker written), "this-boot" (published without fsync during this boot: the page cache still
    holds it), "lost-boot" (published without fsync before the machine restarted: its bytes may be gone), or
    "unknown" (no marker: written by HF Accelerate or an older accel)."""
    if os.path.exists(os.path.join(folder, DURABLE_MARKER)):
        return "durable"
    try:
        with open(os.path.join(folder, UNSYNCED_MARKER)) as f:
            written = f.read().strip()
    except OSError:
        return "unknown"
    return "this-boot" if written == boot_identity() else "lost-boot"
