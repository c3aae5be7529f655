"""The same-host transport: collectives of CPU tensors through POSIX shared memory, one rendezvous per call.

Processes on one host do not need TCP. Each rank owns one shared-memory segment that its peers map (the
protocol is `csrc/shm/`, the tensor side `csrc/shm_bindings/shm_transport.cpp`); a gather of a whole pytree is one
`accel::shm_all_gather` call, where gloo needs a shape exchange plus a collective per leaf.

A group uses it only when every rank agrees that it can (`accel.wire.same_host`, the rules the shared-memory
process group follows too): the same host and /dev/shm (compared, not assumed from LOCAL_WORLD_SIZE), the same
mount and pid namespaces (dead-peer detection uses pids), the native extension loaded everywhere, and no rank
asking for `ACCEL_TRANSPORT=torch`. The decision and the segments'
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
import pickle
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from accel import _ext, ops
from accel.wire import process_group, same_host
from accel.wire.same_host import requested_transport  # noqa: F401  (where `accel env` reads it)
from accel.wire.transport import REDUCE_OPS, TorchDistributedTransport, Transport, reduce_in_dtype

DEFAULT_SLOT_BYTES = 4 << 20


# Room in each slot for a call's header on top of the data: a payload of exactly ACCEL_SHM_SLOT_BYTES (4 MiB,
# say) then travels in one round, not in one round plus a second one for its last header's worth of bytes.
HEADER_ROOM = 4096


def _slot_bytes() -> int:
    return same_host.slot_bytes(DEFAULT_SLOT_BYTES) + HEADER_ROOM


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

    def pad_to_largest(
        self, leaves: list[torch.Tensor], dim: int, pad_index: Any, pad_first: bool
    ) -> list[torch.Tensor]:
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
        return [
            _reduce_in_rank_order(g.view(self.world_size, -1), op).view(leaf.shape).to(leaf.dtype)
            for g, leaf in zip(gathered, leaves)
        ]

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
    _opened = _Opened(group, _open(group.rank(), group.size()) if group.size() > 1 else None)
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


def _facts() -> same_host.Facts:
    # The newest op: an extension built before it cannot join (its protocol differs), so the group falls back.
    native = _ext.status().loaded and _ext.has_kernel("shm_pad_across_processes", "CompositeExplicitAutograd")
    return same_host.local_facts(native)


def _open(rank: int, world_size: int) -> SharedMemoryTransport | None:
    """The default group's shared-memory transport (this process is `rank` of `world_size`), or None; collective."""
    reference = TorchDistributedTransport()
    everyone = reference.all_gather_object(_facts())
    forced = same_host.forced(everyone)
    reason = same_host.why_not(everyone)
    if reason is None:
        # Waits are bounded by the group's own timeout, as the torch.distributed transport's barrier is.
        group = _Group(rank, world_size, everyone[0].token, process_group.group_timeout())
        transport, reason = _set_up(reference, group, same_host.oversubscribed(everyone))
        if transport is not None:
            return transport
        if not forced:  # eligible, yet setting up failed (e.g. too little memory): worth saying, once
            warnings.warn(f"accel: collectives use torch.distributed, not shared memory: {reason}", stacklevel=3)
    if forced:
        raise RuntimeError(f"ACCEL_TRANSPORT=shm, but the shared-memory transport cannot be used: {reason}")
    return None


@dataclasses.dataclass(frozen=True)
class _Group:
    """What setting up a shared-memory group needs to know about this process and the group's agreement."""

    rank: int
    world_size: int
    token: str  # rank 0's, so the same on every rank
    timeout: timedelta  # bounds every wait in the group


def _set_up(
    reference: TorchDistributedTransport, group: _Group, oversubscribed: bool
) -> tuple[SharedMemoryTransport | None, str | None]:
    """Creates every rank's segment, shares the locators, attaches every rank to every other, then closes the
    descriptors (peers opened the segments through them). Every rank gets the same outcome, or the first failure.
    A rank killed at any point leaves nothing behind: the segments have no name anywhere."""
    handle = None

    def create() -> list[int]:
        nonlocal handle
        handle = ops.shm_group_create(
            group.rank, group.world_size, group.token, _slot_bytes(), group.timeout.total_seconds(), oversubscribed
        )
        return ops.shm_group_locator(handle)

    locators, failure = same_host.on_every_rank(create, reference.all_gather_object)
    if failure is None:
        flat = [number for locator in locators for number in locator]
        _, failure = same_host.on_every_rank(lambda: ops.shm_group_attach(handle, flat), reference.all_gather_object)
    if failure is not None:
        if handle is not None:
            ops.shm_group_destroy(handle)
        return None, failure
    ops.shm_group_finish_setup(handle)  # every rank has attached (the exchange above is the barrier)
    return SharedMemoryTransport(handle, group.rank, group.world_size), None
