"""accel's torch.distributed backend for CPU training on one host: collectives through shared memory.

On one host, gloo moves CPU tensors through TCP loopback: ~0.2 to 2 ms for an `all_reduce` of a few bytes, 0.6
GB/s for large ones, paid by DDP for every gradient bucket of every step. This backend moves them through the
shared-memory protocol of `csrc/shm/` (sealed memfd segments, two slots per rank, epoch counters, waits under the
process group's timeout that notice a dead peer) with vectorized fixed-order reductions, and hands everything else to
a gloo backend over the same store. The group it sets up is the process group's one shared-memory group: accel's own
collectives (`accel.wire.shm_transport`: pytree gathers, padding, objects) run on it too, through its handle.

When it is used: when `PartialState` (so `Accelerator` and `accel launch`) starts the default process group of CPU
processes, it starts gloo as HF Accelerate does and then calls `share_memory_in_default_group()`; when it finds a gloo
group someone else initialized (a user's `init_process_group`, Ray Train, torchrun without `accel launch`), it adopts
it the same way: it calls `share_memory_in_default_group()` on that group, over its own store. The ranks decide
together (the facts and rules of `accel.wire.same_host`) whether they can share
memory (one host, one /dev/shm, the native extension everywhere, no ACCEL_TRANSPORT=torch), and if so this backend
becomes the group's CPU backend, with the gloo backend as its delegate. `torch.distributed.get_backend()` still says
"gloo" (so does `PartialState.backend`, as in HF Accelerate), and everything torch does with the default group uses
it unchanged: DDP's gradient buckets, its comm hooks and `broadcast_buffers`, FSDP2's `fully_shard`, DeviceMesh.
Groups can also ask for it by name: `init_process_group("accel")`, `new_group(ranks, backend="accel")` (the backend is
registered with `Backend.register_backend("accel", ..., devices=["cpu"])`; where the ranks cannot share memory such a
group is plain gloo). A group whose ranks span hosts gets `HostLeaderBackend` instead
(`csrc/shm_bindings/host_leader_backend.cpp`): shared memory inside each host, gloo among the hosts' leaders (decided
per group as above; a group with one rank per host stays gloo). GPU groups (NCCL; a group without a CPU backend) are
left alone.

Through shared memory: `all_reduce` (sum, avg, product, min, max, band/bor/bxor, premul_sum; fp32, fp64, fp16,
bf16, int8/16/32/64, uint8, bool), `broadcast`, `all_gather`, `all_gather_into_tensor`, `reduce_scatter_tensor`,
their coalesced forms and `barrier`. Everything else (send/recv, gather, scatter, all_to_all, reduce, the list form of
reduce_scatter, monitored_barrier, other dtypes) is gloo's, over the same store.

Turn it off with `ACCEL_TRANSPORT=torch` (or `ACCEL_DISABLE_NATIVE=1`): the group stays gloo. `ACCEL_TRANSPORT=shm`
makes a group that cannot share memory an error instead of a fallback.

Design decisions, measured on torch 2.13 (2 cores):
- A C++ `c10d::Backend` (`csrc/shm_bindings/shm_process_group.cpp`), not a Python `dist.ProcessGroup` subclass: DDP's
  reducer and FSDP2 call the backend from C++ through the c10d dispatcher, ~1.5 us per call on top of the work,
  while a Python subclass costs ~5 us to reach Python plus ~5 us for the native op it would call (GIL included).
  Python sets it up through `accel._C.SharedMemoryBackend`, a subclass of torch's `Backend` (so a group's
  `_get_backend(cpu)` returns it with `options`, as gloo's).
- Plugged in as the CPU backend of a c10d `ProcessGroup` (`ProcessGroup.setBackend`, what torch does for each device
  of a group), with gloo as its delegate: for the default group after gloo started (its name stays "gloo": torch's
  `monitored_barrier` and code that checks for gloo keep working), for named groups through the creator registered
  with `Backend.register_backend`.
- Collectives are synchronous: done when the call returns (no stream to overlap on a CPU; a communication thread
  would take a core from the backward pass). All-reduces are one round with no barrier after it (one-shot: every
  rank reduces every rank's slot) or, from 3 ranks above 256 KiB, a reduce-scatter then all-gather inside shared
  memory, each rank reducing its slice (the two schemes of DeepSpeed's shared-memory all-reduce; see
  DEFAULT_SLOT_BYTES and ONE_SHOT_BYTES_FROM_THREE_RANKS for the measurements behind the sizes). Every element is
  combined in rank order, fp16/bf16 in fp32: bit-identical on every rank.
- A collective reads and writes its tensors as gloo does, as memory unseen by autograd (c10d collectives are not
  differentiable): a Parameter or a view of one takes part as it is, its version unchanged. Non-contiguous tensors
  go through a contiguous copy, so a strided view's own elements are moved (gloo moves numel elements of memory from
  its first, which are other elements for a column); an expanded tensor cannot receive one result per element and
  is refused, after the exchange, so the group stays usable.
- Unlike gloo, AVG and PREMUL_SUM work (FSDP2 asks for AVG). PREMUL_SUM scales the sum (NCCL scales each input: the
  same value up to rounding) and its factor must be the same on every rank. Errors are raised by the call itself (the
  collective is synchronous), not by `Work.wait()`: DistBackendError when the group fails (a peer died, timed out or
  sent garbage; the group is unusable afterwards), RuntimeError "accel collective mismatch" when ranks called
  different collectives (the group stays usable).
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from accel import _ext, ops
from accel.env_vars import get_setting
from accel.wire import same_host
from accel.wire.gloo_workers import wait_for_gloo_workers_at_exit

BACKEND = "accel"
# The data one round carries per rank (ACCEL_SHM_SLOT_BYTES, rank 0's value; rounded up to whole cache lines), for
# the backend's collectives and accel's own alike. A large all-reduce streams through the slots, and a chunk that
# stays in the cache between being copied in and being reduced by every rank is what makes it fast. Measured on 2
# ranks (2-core Xeon), 32 MiB per rank: 7.0 ms with 4 MiB slots, 6.2 with 1 MiB, 5.2 with 512 KiB, 5.0 with 256 KiB;
# 4 MiB per rank: 0.83, 0.74, 0.60, 0.63 ms.
DEFAULT_SLOT_BYTES = 512 << 10
# All-reduces up to this many bytes (ACCEL_SHM_ONE_SHOT_BYTES, rank 0's value) run one-shot, every rank reducing
# every rank's data; larger ones as a reduce-scatter then an all-gather, each rank reducing its slice. Per byte of
# payload a rank moves 3 + world bytes one-shot against about 5 + 1/world sliced, so on 2 ranks one-shot wins at every
# size (32 MiB: 5.0 against 6.2 ms) and from 3 ranks the slices do (4 ranks on 2 cores, 32 MiB: 18.5 against 23.9 ms).
ONE_SHOT_BYTES_FROM_THREE_RANKS = 256 << 10

_registered = False


def share_memory_in_default_group() -> Any:
    """Makes this backend the default group's CPU backend when its ranks can share memory.

    Collective: every rank of the default group (a gloo group of CPU processes) calls it, and all reach the same
    outcome. `PartialState` calls it for the group it starts and for one it adopts. A group that shares memory
    already is returned as it is (no collective then); one that stayed gloo decides again, so every rank must make
    the same calls. A group whose CPU backend is not gloo (or that has none: NCCL) is left as it is, with no
    collective.

    Returns:
        The backend (an `accel._C.SharedMemoryBackend`; `rounds()` counts its shared-memory rounds), or None when
        the group stays gloo.
    """
    wait_for_gloo_workers_at_exit()  # the group's gloo threads, whether it shares memory or not
    group = dist.distributed_c10d._get_default_group()
    cpu = _cpu_backend(group)
    if cpu is not None and cpu.name() == BACKEND:
        return cpu
    if group.size() == 1 or cpu is None or cpu.name() != "gloo":
        return None
    store = dist.PrefixStore("accel/default/", dist.distributed_c10d._get_default_store())
    return _share_memory(StoreRounds(store, group.rank(), group.size()), group, cpu.options._timeout)


def shared_memory_backend(group: Any) -> Any:
    """`group`'s shared-memory backend (an `accel._C.SharedMemoryBackend`, whose one group spans all its ranks), or
    None when the group does not share memory, or only inside each of its hosts (a `HostLeaderBackend`)."""
    cpu = _cpu_backend(group)
    if cpu is None or cpu.name() != BACKEND:
        return None
    from accel import _C

    return cpu if isinstance(cpu, _C.SharedMemoryBackend) else None


def _cpu_backend(group: Any) -> Any:
    """The group's CPU backend, or None for a group without one (an NCCL-only group: its backend names are the same on
    every rank, so every rank returns alike)."""
    try:
        return group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None


def register() -> None:
    """Registers the "accel" backend with torch.distributed (once per process)."""
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create_backend, devices=["cpu"])
        _registered = True


def _native_ready() -> bool:
    # The newest ops of each side: an extension built before them cannot join (its protocol differs).
    return (
        _ext.status().loaded
        and _ext.has_kernel("reduce_in_order_", "CPU")
        and _ext.has_kernel("shm_pad_across_processes", "CompositeExplicitAutograd")
    )


def _slot_bytes() -> int:
    return -(-same_host.slot_bytes(DEFAULT_SLOT_BYTES) // 64) * 64


def _one_shot_bytes(world_size: int, setting: str | None) -> int:
    """The one-shot all-reduce limit for a shared-memory group of `world_size` ranks, given ACCEL_SHM_ONE_SHOT_BYTES."""
    if not setting:
        return 2**62 if world_size <= 2 else ONE_SHOT_BYTES_FROM_THREE_RANKS
    if not setting.strip().isdigit():
        raise ValueError(f"ACCEL_SHM_ONE_SHOT_BYTES={setting!r}: expected a number of bytes")
    return int(setting)


# --- creating a group: torch.distributed calls _create_backend on every rank of a new group ------------------------


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What one rank tells the others before they decide together."""

    host: same_host.Facts  # host identity, extension, ACCEL_TRANSPORT, token, CPUs
    slot_bytes: int
    one_shot_setting: str | None  # ACCEL_SHM_ONE_SHOT_BYTES (checked when stated)


def _create_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The CPU side of a new "accel" group: a ProcessGroup whose CPU backend shares memory, with gloo as its delegate;
    plain gloo where the ranks cannot share memory (or for a group of one). Collective over the group's store."""
    wait_for_gloo_workers_at_exit()
    gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if world_size == 1:
        return gloo
    group = dist.ProcessGroup(store, rank, world_size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    shared = _share_memory(StoreRounds(store, rank, world_size), group, timeout)
    return gloo if shared is None else group


def _share_memory(rounds: StoreRounds, group: Any, timeout: timedelta) -> Any:
    """Installs the backend into `group` (its CPU backend becomes the delegate) when every rank can share memory.
    Returns the backend, or None when the group stays as it was; the same outcome on every rank."""
    everyone = rounds.all_gather("facts", _local_facts(rounds.world_size))
    hosts = [facts.host for facts in everyone]
    forced = same_host.forced(hosts)
    reason = same_host.why_not(hosts)
    if reason == same_host.SPANS_HOSTS and same_host.shares_a_host(hosts):
        backend, reason = _set_up_across_hosts(rounds, group, everyone, timeout)
        if backend is not None:
            return backend
    elif reason is None:
        backend, reason = _set_up(rounds, group, everyone, timeout)
        if backend is not None:
            return backend
        if not forced:  # eligible, yet setting up failed (e.g. too little memory): worth saying, once
            warnings.warn(f"accel: the process group uses gloo, not shared memory: {reason}", stacklevel=3)
    if forced:
        raise RuntimeError(f"ACCEL_TRANSPORT=shm, but the process group cannot use shared memory: {reason}")
    return None


def _local_facts(world_size: int) -> _Facts:
    setting = get_setting("SHM_ONE_SHOT_BYTES")
    _one_shot_bytes(world_size, setting)  # a bad value stops every rank's set-up here, naming it
    return _Facts(same_host.local_facts(_native_ready()), _slot_bytes(), setting)


def _set_up(rounds: StoreRounds, group: Any, everyone: list[_Facts], timeout: timedelta) -> tuple[Any, str | None]:
    """Every rank's segment in one shared-memory group, then the backend on it installed into `group`: (backend,
    None), or (None, the first failure) on every rank alike."""
    handle, failure = _attach(rounds, list(range(rounds.world_size)), everyone, timeout)
    if failure is not None:
        return None, failure
    from accel import _C

    one_shot = _one_shot_bytes(rounds.world_size, everyone[0].one_shot_setting)
    backend = _C.SharedMemoryBackend(handle, one_shot)  # releases the group when it goes
    backend.install(group)  # every rank has attached (the exchange above is the barrier)
    return backend, None


def _set_up_across_hosts(
    rounds: StoreRounds, group: Any, everyone: list[_Facts], timeout: timedelta
) -> tuple[Any, str | None]:
    """A group that spans hosts: the ranks of each host attach a shared-memory group of their own, the hosts' leaders
    (each host's lowest rank) start a gloo group among themselves over the process group's store, on the network
    devices of the group's own gloo, and every rank installs a `HostLeaderBackend` into `group`: (backend, None), or
    (None, the first failure) on every rank alike."""
    layout = same_host.host_layout([facts.host for facts in everyone])
    host = next(index for index, ranks in enumerate(layout) if rounds.rank in ranks)
    handle, failure = _attach(rounds, layout[host], everyone, timeout)
    if failure is not None:
        return None, failure
    from accel import _C

    try:
        leaders = None
        if layout[host][0] == rounds.rank:  # collective among the leaders only, under the process group's timeout
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = _cpu_backend(group).options._devices
            store = dist.PrefixStore(f"accel/{rounds.generation}/leaders/", rounds.store)
            leaders = dist.ProcessGroupGloo(store, host, len(layout), options)
        one_shot = _one_shot_bytes(len(layout[host]), everyone[0].one_shot_setting)  # rank 0's setting, as for one host
        backend = _C.HostLeaderBackend(handle, rounds.rank, rounds.world_size, layout, leaders, one_shot)
    except BaseException:
        ops.shm_group_destroy(handle)  # no backend holds the host's group yet
        raise
    backend.install(group)
    return backend, None


def _attach(
    rounds: StoreRounds, ranks: list[int], everyone: list[_Facts], timeout: timedelta
) -> tuple[int | None, str | None]:
    """Creates this rank's segment of the shared-memory group of `ranks` (this rank among them, numbered in their
    order; the first one's token names the group) and attaches to its peers' segments: (handle, None), or (None, the
    first failure) on every rank of the process group alike. A rank killed at any point leaves nothing behind (the
    segments have no name anywhere)."""
    handle = None

    def create() -> list[int]:
        nonlocal handle
        handle = ops.shm_group_create(
            ranks.index(rounds.rank),
            len(ranks),
            everyone[ranks[0]].host.token,
            everyone[0].slot_bytes,
            timeout.total_seconds(),
            same_host.oversubscribed([everyone[rank].host for rank in ranks]),
        )
        return ops.shm_group_locator(handle)

    locators, failure = rounds.on_every_rank("create", create)
    if failure is None:
        flat = [number for rank in ranks for number in locators[rank]]
        _, failure = rounds.on_every_rank("attach", lambda: ops.shm_group_attach(handle, flat))
    if failure is not None:
        if handle is not None:
            ops.shm_group_destroy(handle)
        return None, failure
    return handle, None


class StoreRounds:
    """All-gathers of small picklable values through a group's store, while the group itself is being built.

    Keys carry a per-rank generation count, so a store reused by a later group of the same name (elastic restarts
    share the agent's store) never serves an earlier group's values. Every wait is bounded by the store's timeout,
    which is the process group's.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.generation = store.add(f"accel/generation/{rank}", 1)

    def all_gather(self, name: str, value: Any) -> list[Any]:
        prefix = f"accel/{self.generation}/{name}"
        self.store.set(f"{prefix}/{self.rank}", pickle.dumps(value))
        return [pickle.loads(self.store.get(f"{prefix}/{rank}")) for rank in range(self.world_size)]

    def on_every_rank(self, name: str, step: Callable[[], Any]) -> tuple[list | None, str | None]:
        """`same_host.on_every_rank` over this store, under the round `name`."""
        return same_host.on_every_rank(step, lambda outcome: self.all_gather(name, outcome))


if _native_ready():
    register()
