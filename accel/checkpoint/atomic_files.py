"""Files that appear complete or not at all: written under a temporary name nobody can guess, created exclusively,
fsync'd (when durable), renamed (or swapped) into place, the folder fsync'd; the leftovers of dead writers found
by the pid in their names.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
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
    temporary = temporary_name(path)
    fd = create_exclusive(temporary)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        remove_quietly(temporary)
        raise
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
    later save can tell the leftovers of a killed one."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")


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


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
