"""accel's own collectives on the process group's shared-memory group, one rendezvous per call.

Processes on one host do not need TCP. When the ranks of the default process group share memory, its CPU backend is
accel's (`accel.wire.shm_process_group`: each rank owns one shared-memory segment its peers map; the protocol is
`csrc/shm/`), and accel's own collectives run on that same group: a gather of a whole pytree is one
`accel::shm_all_gather` call on the group's handle (the tensor side is `csrc/shm_bindings/shm_transport.cpp`), where
gloo needs a shape exchange plus a collective per leaf; reductions are the backend's own (`torch.distributed`'s
all_reduce on the group). One segment per rank, one set-up, one lock: a collective of accel's and one of torch's
(DDP, FSDP2) on the group queue for the same slots, in the order the program makes them.

Whether the group shares memory is decided once, when `PartialState` starts or adopts it (the rules are
`accel.wire.same_host`: the same host and /dev/shm, compared rather than assumed from LOCAL_WORLD_SIZE, the same
mount and pid namespaces, the native extension everywhere, no rank asking for `ACCEL_TRANSPORT=torch`); a group that
does not uses torch.distributed for accel's collectives too. `ACCEL_SHM_SLOT_BYTES` is the data one round carries
per rank; larger payloads go in rounds.

Every wait is bounded by the process group's timeout, and a rank that dies mid-call makes the others raise
an error naming it. A segment never has a name in /dev/shm (a sealed memfd that peers open through its
creator's /proc/<pid>/fd), so no crash, SIGKILL or SIGTERM at any moment, set-up included, can leave one
behind: the memory goes away with the last process mapping it. Forked children (DataLoader workers) do not
inherit the mappings. With more ranks than CPUs (the union of the ranks' CPU affinities, capped by a cgroup
CPU quota), waits sleep early instead of spinning, so a waiting rank does not hold a core a peer needs.
"""

from __future__ import annotations

import pickle
import weakref
from typing import Any

import torch
import torch.distributed as dist

from accel import ops
from accel.wire import shm_process_group
from accel.wire.byte_views import byte_view, dense_values, holds_values
from accel.wire.same_host import requested_transport  # noqa: F401  (where `accel env` reads it)
from accel.wire.transport import REDUCE_OPS, Transport, exact_reduce_op, reduce_buffer


def _inputs(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    # The ops have no autograd formula (a gather is not differentiable, as in HF Accelerate).
    return [leaf.detach() if leaf.requires_grad else leaf for leaf in leaves]


class SharedMemoryTransport(Transport):
    """Collectives of CPU tensors through the shared-memory group `handle` (the process group's); see the module
    docstring."""

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
        sent = [byte_view(dense_values(leaf)) for leaf in leaves] if self.rank == src else []
        received = self._bytes_of(src, torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8), "broadcast")
        if self.rank != src:
            offset = 0
            for leaf in leaves:
                size = leaf.numel() * leaf.element_size()
                _write_bytes(leaf.detach(), received[offset : offset + size])
                offset += size
        return leaves

    def all_reduce(self, leaves: list[torch.Tensor], op: str) -> list[torch.Tensor]:
        """One all_reduce per leaf on the process group, whose backend is the same shared-memory group: its C++
        reductions combine every rank's values in rank order, so every rank gets the same bits in one round."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {REDUCE_OPS}")
        buffers = [reduce_buffer(leaf) for leaf in leaves]
        for buffer in buffers:
            dist.all_reduce(buffer, exact_reduce_op(buffer, op))
        return [buffer.to(leaf.dtype) for leaf, buffer in zip(leaves, buffers)]

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
    target = leaf if holds_values(leaf) else torch.empty_like(leaf, memory_format=torch.contiguous_format)
    byte_view(target).copy_(data)
    if target is not leaf:
        leaf.copy_(target)


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


# --- the group: the process group's own ---------------------------------------------------------------------------


_cached: tuple[weakref.ref, SharedMemoryTransport | None] | None = None  # (the default group, its transport)


def shared_memory_transport() -> SharedMemoryTransport | None:
    """The default process group's shared-memory transport, or None when the group does not share memory.

    Runs before every collective: the answer is cached per default process group (held weakly: a destroyed group
    and its segments are not kept alive here), so a call costs one attribute read and one identity check.
    """
    global _cached
    group = _default_group()
    cached = _cached
    if cached is not None and cached[0]() is group:
        return cached[1]
    if group is None:
        return None
    backend = shm_process_group.shared_memory_backend(group)
    transport = None if backend is None else SharedMemoryTransport(backend.handle(), group.rank(), group.size())
    _cached = (weakref.ref(group), transport)
    return transport


# c10d's registry of groups, one object for the life of the process (read before every collective).
_WORLD = dist.distributed_c10d._world if dist.is_available() else None


def _default_group() -> Any:
    return None if _WORLD is None else _WORLD.default_pg
