"""Files that appear complete or not at all: written under a temporary name nobody can guess, created exclusively,
fsync'd (when durable), renamed (or swapped) into place, the folder fsync'd; the leftovers of dead writers found
by the pid in their names; files and folders removed at once with the freeing of their blocks left for later
(`UnlinkedFiles`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import resource
import secrets
import stat
import threading
from collections.abc import Callable
from typing import IO


def write_atomically(path: str, write: Callable[[IO], None], mode: str = "wb", *, durable: bool = True) -> None:
    """Calls `write(file)` on a new temporary file next to `path`, fsyncs it and renames it over `path`.

    A reader sees the old file or the complete new one, never a part; a crash leaves at most a temporary file
    (`.NAME.tmp-PID-RANDOM`), which is removed when `write` raises. The temporary file is created exclusively
    (never through a symbolic link or over an existing file) under a name nobody can guess.

    Args:
        path: The file to (re)place.
        write: Writes the content into the open file it is given.
        mode: The mode the temporary file is opened with ("wb", or "w" for text).
        durable: fsync the file and the folder (False: the bytes may still be in the page cache on return; a
            process kill cannot lose them, a power loss can).
    """
    rename_into_place(write_temporary(path, write, mode, durable=durable), path, durable)


def rename_into_place(temporary: str, path: str, durable: bool) -> None:
    """Renames the complete `temporary` over `path` (removed if that fails); `durable`: then fsyncs the folder."""
    try:
        os.replace(temporary, path)
    except BaseException:
        remove_quietly(temporary)
        raise
    if durable:
        fsync_directory(os.path.dirname(path) or ".")


def write_temporary(path: str, write: Callable[[IO], None], mode: str = "wb", *, durable: bool = True) -> str:
    """`write_atomically` without the rename: returns the complete temporary file's name, for a caller that
    publishes several files together (accel.checkpoint.model_io's journal)."""

    def write_file(fd: int) -> None:
        with os.fdopen(fd, mode, closefd=False) as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())

    return write_temporary_fd(path, write_file)


def write_temporary_fd(path: str, write: Callable[[int], None]) -> str:
    """A new temporary file next to `path` (`temporary_name`, created exclusively) that `write(fd)` fills (and
    fsyncs, for a durable write); returns its name. The descriptor is closed on return; the file is removed if
    `write` raises. The one way every writer of a file that is renamed into place makes it (file objects through
    `write_temporary`, safetensors' parallel writers on the descriptor itself)."""
    temporary = temporary_name(path)
    fd = create_exclusive(temporary)
    try:
        write(fd)
    except BaseException:
        remove_quietly(temporary)
        raise
    finally:
        os.close(fd)
    return temporary


def exchange(a: str, b: str) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE): atomically swaps two existing paths (files or folders); False where the
    system cannot (no renameat2, or a filesystem without it: NFS, CIFS, FUSE, older kernels).

    Cheaper than a rename over an existing file, too: ext4 starts writing the new file back inside such a rename
    (auto_da_alloc), ~40 ms per 100 MiB on the critical path, and the old file's removal can then happen later."""
    function = getattr(_libc, "renameat2", None)
    if function is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if function(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap '{a}' and '{b}': {os.strerror(code)}")


_libc = ctypes.CDLL(None, use_errno=True)


def temporary_name(path: str) -> str:
    """A name next to `path` that nobody can guess (64 random bits), marked with this process's id so that a
    later save can tell the leftovers of a killed one (`TEMPORARY_NAME` matches it)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


# What `temporary_name` gives, without the folder: `name` is the final name, `pid` the writer's process id.
TEMPORARY_NAME = re.compile(r"\.(?P<name>[^/\0]+)\.tmp-(?P<pid>\d+)-[0-9a-f]{16}")


def create_exclusive(path: str, mode: int = 0o644) -> int:
    """A descriptor of a new file at `path`, open for writing; fails if anything exists there, a symbolic link
    included (O_EXCL | O_NOFOLLOW), so that a name planted in a shared folder cannot redirect the write."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def fsync_directory(folder: str) -> None:
    """Makes renames inside `folder` durable (a crash after the rename keeps the new name)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Removes `path` if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def process_alive(pid: int) -> bool:
    """Whether process `pid` still runs (temporary names carry their writer's pid: a dead writer's are orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- removing now, freeing later ------------------------------------------------------------------------------------

# Files from this size on are held open when unlinked: freeing their blocks is the slow part of the removal. A
# smaller one is freed by its unlink at once, for less than holding a descriptor costs.
_HOLD_FROM_BYTES = 1 << 20


def _descriptor_budget() -> int:
    """How many unlinked files the process may hold open at once: at most 1024, and a quarter of its descriptor
    limit (1024 by default on many systems), so that holding them never makes the program's own opens fail."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1024 if soft == resource.RLIM_INFINITY else max(0, min(1024, soft // 4))


class UnlinkedFiles:
    """Removes files and folder trees at once and keeps the large files open, so that their blocks are freed only
    when `close` runs (elsewhere: accel.checkpoint.background hands it to its worker).

    Removing a directory entry is cheap; freeing a file's blocks is not (ext4: ~30 ms per 100 MiB), and the kernel
    does that when the last descriptor of an unlinked file closes. So a save that replaces a checkpoint removes
    the old one's names before it returns (nothing changes in the folder after that) and leaves only the freeing
    for later. At most `_descriptor_budget()` files are held process-wide; beyond, a file is freed at once.
    """

    _lock = threading.Lock()
    _held_in_process = 0
    _budget = _descriptor_budget()

    def __init__(self) -> None:
        self._fds: list[int] = []

    def __len__(self) -> int:
        return len(self._fds)

    def unlink(self, name: str, dir_fd: int | None = None) -> None:
        """Removes the file (or symbolic link) `name`, if it is there, holding it open when it is large."""
        fd = self._open_if_large(name, dir_fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            if fd is not None:
                os.close(fd)
            return
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if fd is not None:
            self._hold(fd)

    def remove_tree(self, folder: str) -> None:
        """Removes `folder` and everything in it (symbolic links are removed, never followed), if it is there."""
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            self._empty(fd)
        finally:
            os.close(fd)
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Closes every held file: the kernel frees their blocks now."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        with UnlinkedFiles._lock:
            UnlinkedFiles._held_in_process -= len(fds)

    def _empty(self, dir_fd: int) -> None:
        with os.scandir(dir_fd) as entries:
            children = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for name, is_folder in children:
            if not is_folder:
                self.unlink(name, dir_fd)
                continue
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            try:
                self._empty(child)
            finally:
                os.close(child)
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass

    @staticmethod
    def _open_if_large(name: str, dir_fd: int | None) -> int | None:
        try:  # O_NONBLOCK: a FIFO planted in the folder must not block the open
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:  # a symbolic link, gone already, unreadable: unlinked without holding it
            return None
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_blocks * 512 >= _HOLD_FROM_BYTES:
            return fd
        os.close(fd)
        return None

    def _hold(self, fd: int) -> None:
        with UnlinkedFiles._lock:
            held = UnlinkedFiles._held_in_process < UnlinkedFiles._budget
            if held:
                UnlinkedFiles._held_in_process += 1
        if held:
            self._fds.append(fd)
        else:  # over the budget: freed now, on the caller's time
            os.close(fd)
