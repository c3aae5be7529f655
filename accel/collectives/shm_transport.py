"""The same-host transport: collectives of CPU tensors through POSIX shared memory, one rendezvous per call.

Processes on one host do not need TCP. Each rank owns one shared-memory segment that its peers map (the
protocol is `csrc/shm/`, the tensor side `csrc/cpu/shm_transport.cpp`); a gather of a whole pytree is one
`accel::shm_all_gather` call, where gloo needs a shape exchange plus a collective per leaf.

A group uses it only when every rank agrees that it can: the same host and /dev/shm (compared, not assumed
from LOCAL_WORLD_SIZE), the same mount and pid namespaces (dead-peer detection uses pids), the native
extension loaded everywhere, and no rank asking for `ACCEL_TRANSPORT=torch`. The decision and the segments'
setup are collective and run once per process group, at its first collective; every rank reaches the same
decision, or they would wait in different transports. `ACCEL_TRANSPORT=shm` makes ineligibility an error
(benchmarks, debugging). `ACCEL_SHM_SLOT_BYTES` sizes each of a rank's two slots (default 4 MiB); larger
payloads go in rounds.

Every wait is bounded by the process group's timeout, and a rank that dies mid-call makes the others raise
an error naming it. The segments are unlinked as soon as every rank has mapped them, so nothing is left in
/dev/shm even after a crash.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import secrets
import socket
import warnings
from typing import Any

import torch
import torch.distributed as dist

from accel import _ext
from accel._env import get_setting
from accel.collectives.transport import REDUCE_OPS, TorchDistributedTransport, Transport, reduce_in_dtype

TRANSPORT_CHOICES = ("auto", "shm", "torch")
DEFAULT_SLOT_BYTES = 4 << 20


def requested_transport() -> str:
    """ACCEL_TRANSPORT: "auto" (default), "shm" or "torch"."""
    choice = (get_setting("TRANSPORT") or "auto").strip().lower()
    if choice not in TRANSPORT_CHOICES:
        raise ValueError(f"ACCEL_TRANSPORT={choice!r}: expected one of {', '.join(TRANSPORT_CHOICES)}")
    return choice


def _slot_bytes() -> int:
    value = get_setting("SHM_SLOT_BYTES")
    slot = int(value) if value else DEFAULT_SLOT_BYTES
    if slot < 4096:
        raise ValueError(f"ACCEL_SHM_SLOT_BYTES={value}: a slot holds at least 4096 bytes")
    return slot


def _inode(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What one rank tells the others before they decide together."""

    host: tuple  # equal on every rank of a group that may share memory
    native: bool
    choice: str
    token: str


def _host_identity() -> tuple:
    namespaces = tuple(_inode(f"/proc/self/ns/{name}") for name in ("mnt", "pid"))
    return socket.gethostname(), _boot_id(), _inode("/dev/shm"), namespaces


def _why_not(everyone: list[_Facts]) -> str | None:
    """Why this group cannot use shared memory (None: it can); the same answer on every rank."""
    if any(facts.choice == "torch" for facts in everyone):
        return "ACCEL_TRANSPORT=torch"
    if not all(facts.native for facts in everyone):
        missing = [rank for rank, facts in enumerate(everyone) if not facts.native]
        return f"the native extension is not loaded on process(es) {missing} (see `accel env`)"
    if any(facts.host != everyone[0].host for facts in everyone):
        return "the processes are not all on one host with a shared /dev/shm"
    return None


class SharedMemoryTransport(Transport):
    """Collectives of CPU tensors through the shared-memory group `handle`; see the module docstring."""

    def __init__(self, handle: int, rank: int, world_size: int):
        self.handle, self.rank, self.world_size = handle, rank, world_size

    def all_gather(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        from accel import ops

        return ops.shm_all_gather(self.handle, [leaf.detach() for leaf in leaves])

    def all_gather_ragged(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.all_gather(leaves)

    def all_gather_shapes(self, leaves: list[torch.Tensor]) -> list[list[tuple[int, ...]]]:
        return self.all_gather_object([tuple(leaf.shape) for leaf in leaves])

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        sent = [leaf.detach().contiguous().reshape(-1).view(torch.uint8) for leaf in leaves] if self.rank == src else []
        received = self._bytes_of(src, torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8))
        if self.rank != src:
            offset = 0
            for leaf in leaves:
                size = leaf.numel() * leaf.element_size()
                _write_bytes(leaf.detach(), received[offset : offset + size])
                offset += size
        return leaves

    def all_reduce(self, leaves: list[torch.Tensor], op: str) -> list[torch.Tensor]:
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {REDUCE_OPS}")
        flat = [leaf.detach().reshape(-1) for leaf in leaves]
        gathered = self.all_gather(flat)
        return [_reduce_in_rank_order(g.view(self.world_size, -1), op).view(leaf.shape).to(leaf.dtype)
                for g, leaf in zip(gathered, leaves)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        data, lengths = self._all_bytes(_pickled(obj))
        return [pickle.loads(part.numpy().tobytes()) for part in torch.split(data, lengths.tolist())]

    def broadcast_object_list(self, object_list: list[Any], src: int) -> list[Any]:
        sent = _pickled(object_list) if self.rank == src else torch.empty(0, dtype=torch.uint8)
        received = self._bytes_of(src, sent)
        if self.rank != src:  # the source keeps its own objects, as with torch.distributed
            object_list[:] = pickle.loads(received.numpy().tobytes())
        return object_list

    def barrier(self) -> None:
        self._all_bytes(torch.empty(0, dtype=torch.uint8))

    def _all_bytes(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from accel import ops

        return ops.shm_all_gather_bytes(self.handle, data)

    def _bytes_of(self, src: int, data: torch.Tensor) -> torch.Tensor:
        gathered, lengths = self._all_bytes(data)
        start = int(lengths[:src].sum())
        return gathered[start : start + int(lengths[src])]


def _write_bytes(leaf: torch.Tensor, data: torch.Tensor) -> None:
    """Overwrites `leaf`'s elements with the raw bytes `data` (which need not be aligned for its dtype)."""
    target = leaf if leaf.is_contiguous() else torch.empty_like(leaf, memory_format=torch.contiguous_format)
    target.reshape(-1).view(torch.uint8).copy_(data)
    if target is not leaf:
        leaf.copy_(target)


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _reduce_in_rank_order(parts: torch.Tensor, op: str) -> torch.Tensor:
    """`parts[0] op parts[1] op ...`, left to right: the same order, so the same bits, on every rank."""
    dtype = reduce_in_dtype(parts.dtype)
    if parts.dtype == torch.bool:
        combine = torch.logical_and if op == "min" else torch.logical_or
    else:
        combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    result = parts[0].to(dtype, copy=True)
    for part in parts[1:]:
        result = combine(result, part.to(dtype), out=result)
    return result


# --- the group: one per process group, opened collectively at its first collective --------------------------------


@dataclasses.dataclass
class _Opened:
    process_group: Any  # the default group it was opened for (a new one needs a new decision)
    transport: SharedMemoryTransport | None


_opened: _Opened | None = None


def shared_memory_transport() -> SharedMemoryTransport | None:
    """This process group's shared-memory transport, or None when it cannot use one. Collective on first use."""
    global _opened
    group = _default_group()
    if group is None:
        return None
    if _opened is None or _opened.process_group is not group:
        close()
        _opened = _Opened(group, _open(group) if dist.get_world_size() > 1 else None)
    return _opened.transport


def _default_group() -> Any:
    # Runs before every collective: one attribute read instead of the public helpers' chain of properties.
    return dist.distributed_c10d._world.default_pg if dist.is_available() else None


def close() -> None:
    """Unmaps this process's segments (at exit, or when the process group changes)."""
    global _opened
    if _opened is not None and _opened.transport is not None:
        from accel import ops

        ops.shm_group_destroy(_opened.transport.handle)
    _opened = None


atexit.register(close)


def _open(group: Any) -> SharedMemoryTransport | None:
    reference = TorchDistributedTransport()
    choice = requested_transport()
    native = _ext.status().loaded and _ext.has_kernel("shm_all_gather", "CompositeExplicitAutograd")
    everyone = reference.all_gather_object(_Facts(_host_identity(), native, choice, secrets.token_hex(16)))
    forced = any(facts.choice == "shm" for facts in everyone)
    reason = _why_not(everyone)
    if reason is None:
        transport, reason = _set_up(reference, everyone[0].token)
        if transport is not None:
            return transport
        if not forced:  # eligible, yet setting up failed (e.g. /dev/shm too small): worth saying, once
            warnings.warn(f"accel: collectives use torch.distributed, not shared memory: {reason}", stacklevel=3)
    if forced:
        raise RuntimeError(f"ACCEL_TRANSPORT=shm, but the shared-memory transport cannot be used: {reason}")
    return None


def _set_up(reference: TorchDistributedTransport, token: str) -> tuple[SharedMemoryTransport | None, str | None]:
    """Creates, attaches and unlinks the segments; every rank gets the same outcome (or the first failure)."""
    from accel import ops
    from accel.state import PartialState

    state = PartialState()
    handle = None
    steps = [
        lambda: ops.shm_group_create(state.process_index, state.num_processes, token, _slot_bytes(),
                                     state.timeout.total_seconds()),
        lambda: ops.shm_group_attach(handle),
        lambda: ops.shm_group_unlink(handle),
    ]  # fmt: skip
    for number, step in enumerate(steps):
        error = None
        try:
            result = step()
            handle = result if number == 0 else handle
        except RuntimeError as failure:
            error = str(failure)
        errors = reference.all_gather_object(error)  # also the barrier between the steps
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if failed:
            if handle is not None:
                ops.shm_group_destroy(handle)
            rank, message = failed[0]
            return None, f"process {rank}: {message}"
    return SharedMemoryTransport(handle, state.process_index, state.num_processes), None
