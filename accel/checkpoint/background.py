"""What a save leaves for after it returns: durability (accel.checkpoint.durability: fsync, then the durability
record), asynchronous writes and the freeing of removed files' blocks; and what waits for the next call the user
makes (rotation).

Three save modes (`SaveMode`), chosen per call or by `ProjectConfiguration(async_save=..., durable_save=...)`:

- default: the call returns once every file is complete at its final name, in the page cache (as HF's save
  does, at the same speed). A process killed at any moment leaves the previous checkpoint or the new one, never
  a mix. Durability against power loss follows in the background: every file, the folder and its parent are
  fsync'd, then the folder's durability record (`.accel-durability`, created before the folder was published,
  saying "unsynced" and this machine's boot id) is rewritten in place to say "durable". `load_state()` without a
  path skips a checkpoint that was not made durable before the machine restarted, and completes the durability
  of one from this boot itself.
- durable: the call returns once everything is fsync'd and the record says "durable".
- async: the call returns after an in-memory snapshot of the state (one extra copy, kept for the next
  asynchronous save); writing, fsync and publishing run in the background. The next save, `load_state`,
  `end_training` and `wait_for_checkpoint()` join it, and a failure is raised there.

Unlike an asynchronous save, a default-mode save changes no directory entry after it returns (HF's save has
nothing pending either, and a user may remove, move or list the folder at once): the background only fsyncs,
rewrites the record's content through the descriptor it opened (a folder removed or replaced meanwhile is left
alone) and closes removed files (`unlink_now_free_later`: their names go before the call returns, their blocks,
the slow part, are freed on close). Work that changes entries and must wait for durability (rotating out the
newest durable checkpoint) is deferred to the join points the user calls (`BackgroundSaves.defer`).

One worker thread per process runs the jobs in the order they were submitted, and the interpreter waits for it at
exit, so a script that ends right after a save still leaves a durable checkpoint; a failure there that no join
point raised makes the process exit with status 1 (`BackgroundSaves.exit_on_unreported_failure`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from accel.checkpoint.atomic_files import UnlinkedFiles

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
    """A FIFO of save jobs on one worker thread; failures are kept until the next join raises them. Work deferred
    to the join points (`defer`) runs in the caller's thread there."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._failures: list[BaseException] = []
        self._last_asynchronous: Future | None = None
        self._deferred: dict[str, Callable[[], bool]] = {}
        self._runs_deferred_at_exit = False

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
        durability of default-mode saves may go on), then raises the first failure since the last join, or else
        runs the deferred work (`defer`). Only the user's calls join (a save, load_state, wait_for_checkpoint,
        end_training), never the worker."""
        while True:  # a job may queue more (an asynchronous save_model frees the blocks of the files it replaced)
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
        self.run_deferred()

    def busy(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._pending)

    def defer(self, key: str, work: Callable[[], bool]) -> None:
        """Leaves `work` to the join points: it runs in the thread of the user's next save, load_state,
        wait_for_checkpoint or end_training (or at interpreter exit, after the worker finished), and again at
        each one until it returns True (done). It is how a change to directory entries that must wait for the
        worker (removing a checkpoint once a newer one is durable) happens inside a call the user makes, never
        behind their back. A later `defer` with the same `key` replaces it."""
        with self._lock:
            self._deferred[key] = work
            register_exit = not self._runs_deferred_at_exit
            self._runs_deferred_at_exit = True
        if register_exit:  # atexit runs after the interpreter joined the worker: what waited for it can finish
            atexit.register(self._run_deferred_at_exit)

    def run_deferred(self) -> None:
        """Runs the deferred work (see `defer`) in the calling thread; what is done is dropped."""
        with self._lock:
            work = dict(self._deferred)
        for key, function in work.items():
            if function():
                with self._lock:
                    if self._deferred.get(key) is function:
                        del self._deferred[key]

    def _run_deferred_at_exit(self) -> None:
        try:
            self.run_deferred()
        except Exception as error:  # noqa: BLE001 - nobody left to raise it to
            logger.warning("checkpoint work left for the end of the program failed: %s", error)

    def exit_on_unreported_failure(self) -> None:
        """At interpreter exit, once the worker has run its queue: a background failure that no join point raised
        (a script that ends right after an asynchronous save onto a full disk) ends the process with status 1 and
        the error printed, instead of a log line and status 0. Registered before any handler accel's saves add,
        so it runs after them (atexit runs handlers in reverse); os._exit skips the handlers registered before it,
        so it shuts logging down itself."""
        with self._lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        print(
            "accel: a checkpoint saved in the background failed and no later call raised it; exiting with status 1:",
            file=sys.stderr,
        )
        traceback.print_exception(failures[0], file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def free_later(self, unlinked: UnlinkedFiles) -> None:
        """Closes `unlinked` on the worker (freeing their blocks there), or now once the interpreter is shutting
        down and the worker takes no more jobs."""
        if not len(unlinked):
            return
        try:
            self.submit(unlinked.close, "freeing the blocks of removed checkpoint files")
        except RuntimeError:  # cannot schedule new futures after interpreter shutdown
            unlinked.close()


saves = BackgroundSaves()
atexit.register(saves.exit_on_unreported_failure)


# --- removing files -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _freed_later() -> Iterator[UnlinkedFiles]:
    unlinked = UnlinkedFiles()
    try:
        yield unlinked
    finally:  # also what was removed before a failure: its descriptors are closed, never leaked
        saves.free_later(unlinked)


def unlink_now_free_later(paths: list[str]) -> None:
    """Removes the files `paths` (those that are there) before returning; the blocks of the large ones are freed on
    the worker (see accel.checkpoint.atomic_files.UnlinkedFiles)."""
    with _freed_later() as unlinked:
        for path in paths:
            unlinked.unlink(path)


def remove_tree_now_free_later(folder: str) -> None:
    """Removes `folder` and everything in it before returning; the blocks of its large files are freed on the
    worker."""
    with _freed_later() as unlinked:
        unlinked.remove_tree(folder)
