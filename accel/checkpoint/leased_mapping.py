"""Checkpoint files served as memory, zero-copy, yet safe from anyone who rewrites them in place.

Weights served from the CPU in the file's dtype are views of a private (copy-on-write) mapping of the
safetensors file: no copy, and processes on one machine share the page cache. A bare mapping is not safe: a file
truncated underneath kills the reader (SIGBUS), an in-place overwrite (`cp`, `torch.save`, `rsync --inplace`,
another user's or the same user's) silently changes the weights, and a rewrite with the same bytes discards the
process's own edits of a weight. Copying instead costs more than the whole of HF Accelerate's load on these
machines (writing fresh memory runs at ~4 GB/s), so the mapping is guarded instead:

- Every mapped file holds a read lease (fcntl F_SETLEASE): before anyone can open it for writing or truncate it,
  the kernel blocks that writer and signals this process. A watcher thread then copies each of the file's mapped
  regions into private memory and swaps the copy in at the same address (mremap), so every tensor keeps its data
  pointer and its values, the process's own edits included; then it releases the lease and the writer proceeds
  (after a few milliseconds per 100 MiB). Writers that write a new file and rename it over the old one (accel,
  safetensors, transformers, huggingface_hub) do not disturb the mapping and trigger nothing.
- Where a lease cannot be taken, the caller copies: another user's file, a file open for writing right now,
  filesystems without leases (NFS, some FUSE and overlay set-ups), or leases disabled (/proc/sys/fs/leases-enable).

With the native extension, the mapping and its watcher are C++ (`accel::map_file_leased`,
csrc/leased_mapping/leased_mapping.cpp): the watcher needs no GIL, so a writer in this same process that holds
Python's GIL while it opens the file (torch.save's C++ file writer does) waits milliseconds too. Without the
extension this module's Python watcher does the same job, except for that case: the writer holding the GIL blocks
on the lease while the watcher waits for the GIL, until the kernel breaks the lease after
/proc/sys/fs/lease-break-time (45 s by default), and the file then changes under the weights. Forked children
(DataLoader workers) keep their own unguarded copy of the mapping. Set ACCEL_MAP_CHECKPOINTS=0 to always copy.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import logging
import mmap
import os
import signal
import struct
import threading
import weakref

import torch

from accel import _ext, ops
from accel.checkpoint.safetensors_io import FileIdentity, SafetensorsFile

logger = logging.getLogger(__name__)

_F_SETSIG, _F_SETOWN_EX, _F_OWNER_TID = 10, 15, 0
_F_SETLEASE, _F_GETLEASE = getattr(fcntl, "F_SETLEASE", 1024), getattr(fcntl, "F_GETLEASE", 1025)
# A real-time signal, queued per break and sent only to the watcher thread (F_OWNER_TID), which blocks it.
_LEASE_SIGNAL = signal.SIGRTMAX - 5 if hasattr(signal, "SIGRTMAX") else None
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


def enabled() -> bool:
    """Whether checkpoint files may be mapped at all (ACCEL_MAP_CHECKPOINTS=0 turns it off)."""
    return os.environ.get("ACCEL_MAP_CHECKPOINTS", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclasses.dataclass
class _Guard:
    """One leased file: its own descriptor (the lease lives on the open file) and the mappings made of it."""

    fd: int
    path: str
    identity: FileIdentity | None  # what was mapped: a file found otherwise was written before the copy
    regions: list[weakref.ref] = dataclasses.field(default_factory=list)


class _Watcher:
    """The Python fallback's thread that answers lease breaks: copies the broken files' mappings out, then lets the
    writer go (it needs the GIL to run; the native watcher does not)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.guards: dict[int, _Guard] = {}
        self.tid: int | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="accel-checkpoint-leases", daemon=True)
        self.thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, [_LEASE_SIGNAL])  # before any lease names this thread
        self.tid = threading.get_native_id()
        ready.set()
        while True:
            signal.sigwaitinfo([_LEASE_SIGNAL])  # Python's siginfo has no si_fd: ask every lease below
            self._answer_breaks()

    def _answer_breaks(self) -> None:
        with self.lock:
            for guard in list(self.guards.values()):
                try:
                    breaking = fcntl.fcntl(guard.fd, _F_GETLEASE) != fcntl.F_RDLCK
                except OSError:
                    breaking = True
                if breaking:
                    self._detach(guard)

    def _detach(self, guard: _Guard) -> None:
        for region in guard.regions:
            mapping = region()  # held while copying, so that it cannot be unmapped meanwhile
            if mapping is not None:
                _swap_in_private_copy(mapping, _backed_bytes(guard.fd))
        if _identity(guard.fd) == guard.identity:
            logger.warning(
                "'%s' is being written by another program: the weights mapped from it were copied into "
                "memory first, so they do not change",
                guard.path,
            )
        else:  # the kernel broke the lease itself: this thread waited for the GIL (see the module docstring)
            logger.warning(
                "'%s' was written before the weights mapped from it could be copied into memory: they "
                "changed with it (a writer in this process held the GIL)",
                guard.path,
            )
        self.release(guard)

    def release(self, guard: _Guard) -> None:
        """Drops the lease (a blocked writer proceeds) and the descriptor; once only."""
        with self.lock:
            if self.guards.get(guard.fd) is not guard:
                return
            del self.guards[guard.fd]
            try:
                fcntl.fcntl(guard.fd, _F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass
            os.close(guard.fd)

    def lease(self, file: SafetensorsFile) -> _Guard | None:
        """A read lease on `file` whose breaks signal this watcher; None where the system refuses one."""
        fd = os.dup(file.fd)  # the same open file: the lease is the file's, kept while the mapping lives
        try:
            fcntl.fcntl(fd, _F_SETSIG, _LEASE_SIGNAL)
            fcntl.fcntl(fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, self.tid))
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        except OSError as error:
            os.close(fd)
            logger.debug("no read lease on '%s' (%s): its weights are copied", file.path, error)
            return None
        guard = _Guard(fd, file.path, file.header.identity)
        self.guards[fd] = guard
        return guard


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def _get_watcher() -> _Watcher:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


def map_file(file: SafetensorsFile) -> torch.Tensor | None:
    """The whole of `file` as a uint8 tensor over a leased private mapping, pre-faulted from the page cache; None
    when it cannot be guarded (the caller then copies). Raises FileChangedError when the file changed since its
    header was read."""
    size = file.header.identity.size if file.header.identity else 0
    if not enabled() or size == 0:
        return None
    data = _map_natively(file, size) if _native() else _map_in_python(file, size)
    if data is not None:
        int(data[:: mmap.PAGESIZE].sum())  # touch every page now, so the first forward does not pay for it
    return data


def _native() -> bool:
    # Registered for every backend (a descriptor goes in, no tensor), so not under the CPU key native_for asks.
    return _ext.status().loaded and _ext.has_kernel("map_file_leased", "CompositeExplicitAutograd")


def _map_natively(file: SafetensorsFile, size: int) -> torch.Tensor | None:
    data = ops.map_file_leased(file.fd, size, file.path)
    if data.numel() == 0:
        logger.debug("no read lease on '%s': its weights are copied", file.path)
        return None
    file.check_unchanged()  # from the lease on, nobody can change it without our copy first (raising drops it)
    return data


def _map_in_python(file: SafetensorsFile, size: int) -> torch.Tensor | None:
    if _LEASE_SIGNAL is None:
        return None
    watcher = _get_watcher()
    with watcher.lock:  # a break during set-up waits until the mapping is registered, then copies it
        guard = watcher.lease(file)
        if guard is None:
            return None
        try:
            file.check_unchanged()  # from the lease on, nobody can change it without our copy first
            mapping = mmap.mmap(guard.fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            watcher.release(guard)
            raise
        guard.regions.append(weakref.ref(mapping))
        weakref.finalize(mapping, watcher.release, guard)
    return torch.frombuffer(mapping, dtype=torch.uint8)


# --- the copy-out --------------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _identity(fd: int) -> FileIdentity | None:
    try:
        return FileIdentity.of(os.fstat(fd))
    except OSError:
        return None


def _backed_bytes(fd: int) -> int:
    """How much of a mapping of `fd` the file still backs, in whole pages (reading past it raises SIGBUS). All of
    it while the lease holds; less only once the kernel broke the lease itself (see the module docstring)."""
    try:
        return -(-os.fstat(fd).st_size // mmap.PAGESIZE) * mmap.PAGESIZE
    except OSError:
        return 0


def _swap_in_private_copy(mapping: mmap.mmap, backed: int) -> None:
    """Replaces the pages of `mapping` by anonymous memory holding the same bytes (its first `backed` bytes; zeros
    past the file's end), at the same address: the file can then change or shrink without the mapping seeing it.
    The mmap object still unmaps the range when freed."""
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor  # only the address was needed; the export would pin the mmap object
    length = -(-len(mapping) // mmap.PAGESIZE) * mmap.PAGESIZE
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    copy = _libc.mmap(None, length, prot, flags, -1, 0)
    if copy in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "cannot allocate memory for a private copy of a checkpoint mapping")
    ctypes.memmove(copy, address, min(length, backed))
    if _libc.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) != address:
        error = ctypes.get_errno()
        _libc.munmap(copy, length)
        raise OSError(error, "cannot swap a private copy into a checkpoint mapping")
