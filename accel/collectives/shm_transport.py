"""The same-host transport: collectives of CPU tensors through POSIX shared memory, one rendezvous per call.

Processes on one host do not need TCP. Each rank owns one shared-memory segment that its peers map (the
protocol is `csrc/shm/`, the tensor side `csrc/cpu/shm_transport.cpp`); a gather of a whole pytree is one
`accel::shm_all_gather` call, where gloo needs a shape exchange plus a collective per leaf.

A group uses it only when every rank agrees that it can: the same host and /dev/shm (compared, not assumed
from LOCAL_WORLD_SIZE), the same mount and pid namespaces (dead-peer detection uses pids), the native
extension loaded everywhere, and no rank asking for `ACCEL_TRANSPORT=torch`. The decision and the segments'
setup are collective and run once per process group, at its first collective; every rank reaches the same
decision, or they would wait in different transports. `ACCEL_TRANSPORT=shm` makes ineligibility an error
(benchmarks, debugging). `ACCEL_SHM_SLOT_BYTES` is the data one round carries per rank (default 4 MiB; each of
a rank's two slots has HEADER_ROOM more for the call's header); larger payloads go in rounds.

Every wait is bounded by the process group's timeout, and a rank that dies mid-call makes the others raise
an error naming it. A segment never has a name in /dev/shm (a sealed memfd that peers open through its
creator's /proc/<pid>/fd), so no crash, SIGKILL or SIGTERM at any moment, set-up included, can leave one
behind: the memory goes away with the last process mapping it. Forked children (DataLoader workers) do not
inherit the mappings. With more ranks than CPUs (the union of the ranks' CPU affinities, capped by a cgroup
CPU quota), waits sleep early instead of spinning, so a waiting rank does not hold a core a peer needs.
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

from accel import _ext, ops
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


# Room in each slot for a call's header on top of the data: a payload of exactly ACCEL_SHM_SLOT_BYTES (4 MiB,
# say) then travels in one round, not in one round plus a second one for its last header's worth of bytes.
HEADER_ROOM = 4096


def _slot_bytes() -> int:
    value = get_setting("SHM_SLOT_BYTES")
    slot = int(value) if value else DEFAULT_SLOT_BYTES
    if slot < 4096:
        raise ValueError(f"ACCEL_SHM_SLOT_BYTES={value}: a slot holds at least 4096 bytes")
    return slot + HEADER_ROOM


def _inode(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _cpu_quota() -> int | None:
    """The CPUs a cgroup v2 quota (cpu.max) grants this process, rounded up; None without a quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as file:
            quota, period = file.read().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, -(-int(quota) // int(period)))


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
    cpus: frozenset  # the CPUs this rank may run on
    cpu_quota: int | None


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


def _oversubscribed(everyone: list[_Facts]) -> bool:
    """More ranks than the CPUs they can run on together (the same answer on every rank)."""
    cpus = len(frozenset().union(*(facts.cpus for facts in everyone)))
    quotas = [facts.cpu_quota for facts in everyone if facts.cpu_quota is not None]
    return len(everyone) > min([cpus, *quotas])


def _inputs(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    # The ops have no autograd formula (a gather is not differentiable, as in HF Accelerate).
    return [leaf.detach() if leaf.requires_grad else leaf for leaf in leaves]


class SharedMemoryTransport(Transport):
    """Collectives of CPU tensors through the shared-memory group `handle`; see the module docstring."""

    def __init__(self, handle: int, rank: int, world_size: int):
        self.handle, self.rank, self.world_size = handle, rank, world_size

    def all_gather(self, leaves: list[torch.Tensor], call: str = "gather") -> list[torch.Tensor]:
        return ops.shm_all_gather(self.handle, _inputs(leaves), call=call)

    def all_gather_ragged(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.all_gather(leaves)

    def all_gather_shapes(self, leaves: list[torch.Tensor]) -> list[list[tuple[int, ...]]]:
        return self.all_gather_object([tuple(leaf.shape) for leaf in leaves])

    def pad_to_largest(self, leaves: list[torch.Tensor], dim: int, pad_index: Any, pad_first: bool
                       ) -> list[torch.Tensor]:  # fmt: skip
        """One exchange of shapes through shared memory (nothing pickled); padding in the same native call."""
        padded, indices = ops.shm_pad_across_processes(self.handle, _inputs(leaves), dim, pad_index, pad_first)
        if not indices:
            return leaves
        result = list(leaves)
        for index, leaf in zip(indices, padded):
            result[index] = leaf
        return result

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        sent = [leaf.detach().contiguous().reshape(-1).view(torch.uint8) for leaf in leaves] if self.rank == src else []
        received = self._bytes_of(src, torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8), "broadcast")
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
        gathered = self.all_gather(flat, call="reduce")
        return [_reduce_in_rank_order(g.view(self.world_size, -1), op).view(leaf.shape).to(leaf.dtype)
                for g, leaf in zip(gathered, leaves)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        data, lengths = self._all_bytes(_pickled(obj), "gather_object")
        return [pickle.loads(part.numpy().tobytes()) for part in torch.split(data, lengths.tolist())]

    def broadcast_object_list(self, object_list: list[Any], src: int) -> list[Any]:
        sent = _pickled(object_list) if self.rank == src else torch.empty(0, dtype=torch.uint8)
        received = self._bytes_of(src, sent, "broadcast_object_list")
        if self.rank != src:  # the source keeps its own objects, as with torch.distributed
            object_list[:] = pickle.loads(received.numpy().tobytes())
        return object_list

    def barrier(self) -> None:
        self._all_bytes(_NO_BYTES, "wait_for_everyone")

    def _all_bytes(self, data: torch.Tensor, call: str) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.shm_all_gather_bytes(self.handle, data, call)

    def _bytes_of(self, src: int, data: torch.Tensor, call: str) -> torch.Tensor:
        gathered, lengths = self._all_bytes(data, call)
        start = int(lengths[:src].sum())
        return gathered[start : start + int(lengths[src])]


_NO_BYTES = torch.empty(0, dtype=torch.uint8)


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
    """This process group's shared-memory transport, or None when it cannot use one. Collective on first use.

    Runs before every collective: the decision is cached per default process group, so a call costs one
    attribute read and one identity check.
    """
    global _opened
    group = _default_group()
    opened = _opened
    if opened is not None and opened.process_group is group:
        return opened.transport
    if group is None:
        return None
    close()
    _opened = _Opened(group, _open(group) if dist.get_world_size() > 1 else None)
    return _opened.transport


def _default_group() -> Any:
    return dist.distributed_c10d._world.default_pg if dist.is_available() else None


def close() -> None:
    """Unmaps this process's segments (at exit, or when the process group changes)."""
    global _opened
    if _opened is not None and _opened.transport is not None:
        ops.shm_group_destroy(_opened.transport.handle)
    _opened = None


atexit.register(close)


def _facts(choice: str) -> _Facts:
    from accel.cpu_affinity import inherited_cpus

    # The newest op: an extension built before it cannot join (its protocol differs), so the group falls back.
    native = _ext.status().loaded and _ext.has_kernel("shm_pad_across_processes", "CompositeExplicitAutograd")
    return _Facts(_host_identity(), native, choice, secrets.token_hex(16), inherited_cpus(), _cpu_quota())


def _open(group: Any) -> SharedMemoryTransport | None:
    reference = TorchDistributedTransport()
    everyone = reference.all_gather_object(_facts(requested_transport()))
    forced = any(facts.choice == "shm" for facts in everyone)
    reason = _why_not(everyone)
    if reason is None:
        transport, reason = _set_up(reference, everyone[0].token, _oversubscribed(everyone))
        if transport is not None:
            return transport
        if not forced:  # eligible, yet setting up failed (e.g. too little memory): worth saying, once
            warnings.warn(f"accel: collectives use torch.distributed, not shared memory: {reason}", stacklevel=3)
    if forced:
        raise RuntimeError(f"ACCEL_TRANSPORT=shm, but the shared-memory transport cannot be used: {reason}")
    return None


def _set_up(reference: TorchDistributedTransport, token: str, oversubscribed: bool
            ) -> tuple[SharedMemoryTransport | None, str | None]:  # fmt: skip
    """Creates every rank's segment, shares the locators, attaches every rank to every other, then closes the
    descriptors (peers opened the segments through them). Every rank gets the same outcome, or the first failure.
    A rank killed at any point leaves nothing behind: the segments have no name anywhere."""
    from accel.state import PartialState

    state = PartialState()
    handle = None

    def create() -> list[int]:
        nonlocal handle
        handle = ops.shm_group_create(state.process_index, state.num_processes, token, _slot_bytes(),
                                      state.timeout.total_seconds(), oversubscribed)  # fmt: skip
        return ops.shm_group_locator(handle)

    locators, failure = _on_every_rank(reference, create)
    if failure is None:
        flat = [number for locator in locators for number in locator]
        _, failure = _on_every_rank(reference, lambda: ops.shm_group_attach(handle, flat))
    if failure is not None:
        if handle is not None:
            ops.shm_group_destroy(handle)
        return None, failure
    ops.shm_group_finish_setup(handle)  # every rank has attached (the exchange above is the barrier)
    return SharedMemoryTransport(handle, state.process_index, state.num_processes), None


def _on_every_rank(reference: TorchDistributedTransport, step: Any) -> tuple[list | None, str | None]:
    """Runs `step` here and gathers every rank's outcome (a barrier too): (every rank's result, None), or (None,
    the first failure) on every rank alike."""
    result, error = None, None
    try:
        result = step()
    except RuntimeError as failure:
        error = str(failure)
    outcomes = reference.all_gather_object((result, error))
    failed = [(rank, message) for rank, (_, message) in enumerate(outcomes) if message is not None]
    if failed:
        rank, message = failed[0]
        return None, f"process {rank}: {message}"
    return [outcome for outcome, _ in outcomes], None
