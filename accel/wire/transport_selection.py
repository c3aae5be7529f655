"""Which transport carries a collective call: `select_transport`, and `using_transport` to force one.

Above both transports (`accel.wire.transport`, the torch.distributed reference, and
`accel.wire.shm_transport`, shared memory on one host), which import neither this module nor the process
state: the state's barrier and every collective ask here.

Every rank must pick the same transport for a given call, so `select_transport` may only decide from facts that are
equal on every rank (the process group, the leaves' devices, dtypes and shapes when they agree, settings).
"""

from __future__ import annotations

import contextlib

import torch

from accel.wire.shm_transport import shared_memory_transport
from accel.wire.transport import TorchDistributedTransport, Transport

_TORCH_DISTRIBUTED = TorchDistributedTransport()

_forced: Transport | None = None


@contextlib.contextmanager
def using_transport(transport: Transport):
    """Every collective inside uses `transport` (benchmarks and tests compare transports in one job).

    Collective: every rank must enter and leave it at the same point.
    """
    global _forced
    previous, _forced = _forced, transport
    try:
        yield transport
    finally:
        _forced = previous


def select_transport(leaves: list[torch.Tensor]) -> Transport:
    """The transport for one collective call on `leaves` (empty for object collectives); the same on every rank.

    The same-host shared-memory transport for CPU tensors when the group can use it (decided once per process
    group, together, and cached: see `accel.wire.shm_transport`), else torch.distributed.
    """
    if _forced is not None:
        return _forced
    for leaf in leaves:
        if not leaf.is_cpu:
            return _TORCH_DISTRIBUTED
    return shared_memory_transport() or _TORCH_DISTRIBUTED


def shared_memory_handle() -> int | None:
    """The default group's shared-memory handle when `select_transport` would pick shared memory for CPU tensors
    (the group shares memory and no transport is forced); None otherwise. The direct path of the hottest
    collectives (`accel.collectives.direct`) asks this instead of building a transport call."""
    if _forced is not None:
        return None
    transport = shared_memory_transport()
    return None if transport is None else transport.handle
