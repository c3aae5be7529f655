"""The default process group: when to start one, how to adopt it, its timeout, this process's device in it, and its
barrier.

Below `accel.state` (whose `PartialState` starts or adopts the group and records what is resolved here) and below
the collectives' transports (whose torch.distributed transport waits with `default_group_barrier`): both import this
module, and it imports neither; it imports only the shared-memory process group it layers on gloo groups and the
same-host facts. Every wait is bounded by the group's timeout, so a process that never arrives makes the others raise
instead of hanging.

A group accel starts and a group someone else initialized (a user's `init_process_group`, Ray Train's TorchTrainer,
Kubeflow, torchrun without `accel launch`) are treated alike, once per group (`adopt_default_group`): the ranks
exchange their host identities through the group's store, which gives LOCAL_RANK / LOCAL_WORLD_SIZE where the
environment lacks them, and a gloo group whose ranks share one host gets accel's shared-memory backend for its CPU
collectives (`share_memory_in_default_group`; ACCEL_TRANSPORT=torch keeps it gloo); one whose ranks span hosts shares
memory inside each host, its hosts' leaders talking over gloo.
"""

from __future__ import annotations

import inspect
import os
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from accel.env_vars import get_setting
from accel.wire import same_host
from accel.wire.shm_process_group import StoreRounds, share_memory_in_default_group


def launched_distributed(use_cuda: bool) -> bool:
    """HF Accelerate's rule: several processes, or, on CUDA, any process a launcher started (MULTI_GPU even
    alone). One CPU process is `NO`: a process group of one would only add DDP overhead."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return True
    return use_cuda and int(os.environ.get("LOCAL_RANK", -1)) != -1


def wants_cuda(cpu: bool) -> bool:
    """Whether a process asked to run on the CPU (`cpu`) or not uses CUDA: it does when CUDA is available."""
    return not cpu and torch.cuda.is_available()


def _as_timedelta(value: Any, source: str) -> timedelta:
    if isinstance(value, timedelta):
        return value
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r}: expected a timedelta or a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{source}={value!r}: the process group timeout must be positive")
    return timedelta(seconds=seconds)


def requested_timeout(timeout: Any) -> timedelta | None:
    """The `timeout` kwarg, else ACCEL_PROCESS_GROUP_TIMEOUT (seconds), else None (torch's default)."""
    if timeout is not None:
        return _as_timedelta(timeout, "timeout")
    from_env = get_setting("PROCESS_GROUP_TIMEOUT")
    return None if from_env is None else _as_timedelta(from_env, "ACCEL_PROCESS_GROUP_TIMEOUT")


def group_timeout() -> timedelta:
    """The timeout of the initialized default process group (one the user may have created)."""
    backend = dist.get_backend()
    device = torch.device("cuda" if "nccl" in backend else "cpu")
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d._get_default_timeout(backend)


def wait_limit() -> timedelta:
    """How long any wait for another process may last: the initialized default group's timeout, else the one
    `Accelerator` / `PartialState` would give it (ACCEL_PROCESS_GROUP_TIMEOUT), else torch's default (30 minutes)."""
    if dist.is_available() and dist.is_initialized():
        return group_timeout()
    return requested_timeout(None) or timedelta(minutes=30)


def local_rank() -> int:
    """This process's index on its machine in the initialized group: LOCAL_RANK (which `adopt_default_group` exports
    when a launcher did not), else its rank (before the group is adopted)."""
    return int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def device_for(distributed: bool, use_cuda: bool, local_process_index: int) -> torch.device:
    """ACCEL_TORCH_DEVICE if set, else cpu, the current CUDA device (one process) or cuda:LOCAL_RANK."""
    forced = get_setting("TORCH_DEVICE")
    if forced is not None:
        return torch.device(forced)
    if not use_cuda:
        return torch.device("cpu")
    index = local_process_index % torch.cuda.device_count() if distributed else torch.cuda.current_device()
    return torch.device("cuda", index)


def start_process_group(backend: str, timeout: timedelta | None, device: torch.device, kwargs: dict) -> None:
    """Initializes the default group on `backend` (its CUDA device set first); a backend this torch build lacks
    is refused, naming the one to use. `adopt_default_group` then makes it accel's, as any group someone else made.
    """
    if ":" not in backend and not dist.is_backend_available(backend):
        fallback = "nccl" if device.type == "cuda" else "gloo"
        raise ValueError(f"The backend {backend!r} is not available in this torch build; use {fallback!r}.")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=timeout, **_this_attempts_store(timeout, kwargs), **kwargs)


# The default group `adopt_default_group` last took over (a weak reference: a destroyed group must not live on).
_adopted: weakref.ref | None = None


def adopt_default_group() -> None:
    """Makes the initialized default group accel's, whoever started it; once per group.

    Collective over the group's store, on every rank of a group of several processes: each rank tells the others its
    host identity (`same_host.host_identity`), and where LOCAL_RANK is not set, it is exported with LOCAL_WORLD_SIZE
    from them (`export_local_placement`). Then a gloo group moves CPU tensors through shared memory when its ranks
    share one host, and inside each host when they span hosts (`share_memory_in_default_group`; it stays gloo where
    they cannot, and with ACCEL_TRANSPORT=torch). A group without a gloo CPU backend (NCCL) is left as it is. Calling
    it again for the same group (a `PartialState` made again after `_reset_state`) does nothing, so no rank waits for
    a peer that does not call it.
    """
    global _adopted
    group = dist.distributed_c10d._get_default_group()
    if _adopted is not None and _adopted() is group:
        return
    if group.size() > 1:
        export_local_placement(group)
    share_memory_in_default_group()
    _adopted = weakref.ref(group)


def export_local_placement(group: Any) -> tuple[int, int]:
    """This rank's (local rank, local world size) in `group` (the default group), from every rank's host identity
    exchanged through the group's store: the ranks of one host numbered in rank order (`same_host.placement`).
    Exported as LOCAL_RANK and LOCAL_WORLD_SIZE where the environment lacks them (a user's group, Kubeflow's one
    process per pod), as torchrun would have; a launcher's values are kept. Collective: every rank of `group` calls
    it (whether or not its own environment has LOCAL_RANK), bounded by the store's timeout.
    """
    store = dist.PrefixStore("accel/placement/", dist.distributed_c10d._get_default_store())
    hosts = StoreRounds(store, group.rank(), group.size()).all_gather("host", same_host.host_identity())
    local, local_world = same_host.placement(hosts, group.rank())
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local)
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_world))
    return local, local_world


def _this_attempts_store(timeout: timedelta | None, kwargs: dict) -> dict[str, Any]:
    """Under one torch elastic agent that shares its store with the workers (`TORCHELASTIC_USE_AGENT_STORE=True`,
    `GROUP_WORLD_SIZE=1`: torchrun or `accel launch` on one machine), the store of this run attempt
    (`TORCHELASTIC_RESTART_COUNT`), as init_process_group's `store`, `rank` and `world_size`; else, or when the caller
    gives an init_method or a store, nothing.

    Such an agent keeps one store for the whole job, and torch 2.13's env:// rendezvous connects the workers of every
    attempt to it without a prefix of their own (torch/distributed/rendezvous.py, `_create_c10d_store`; pytorch#135712).
    A worker group restarted after a failure (`--max_restarts`) then read the keys its previous attempt left: gloo
    connected to the dead processes' addresses and timed out ("connectFullMesh failed ... Connection refused"), and
    accel's set-up rounds could read a dead process's values. One agent's restart count is every worker's; agents on
    several machines count their own restarts, so there `accel launch` has torch give each attempt a store of its own
    instead (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, accel.cli.launch.restart_env)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if not shared or os.environ.get("GROUP_WORLD_SIZE", "1") != "1" or {"init_method", "store"} & set(kwargs):
        return {}
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    wait = timeout or dist.distributed_c10d.default_pg_timeout
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=wait
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"accel/attempt_{attempt}/", client), "rank": rank, "world_size": world_size}


# torch.distributed.barrier takes a timeout from torch 2.12 on; before, the group's own timeout bounds it.
_BARRIER_TAKES_TIMEOUT = "timeout" in inspect.signature(dist.barrier).parameters


def barrier(backend: str, device: torch.device, timeout: timedelta, debug: bool) -> None:
    """A barrier bounded by `timeout` (by the group's timeout on a torch whose barrier takes none); in debug mode on
    gloo, the error names the ranks that did not arrive."""
    if debug and backend == "gloo":
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        return
    bound = {"timeout": timeout} if _BARRIER_TAKES_TIMEOUT else {}
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index], **bound)
    else:
        dist.barrier(**bound)


def default_group_barrier() -> None:
    """`barrier` on the initialized default group, bounded by the group's own timeout, on the device `PartialState`
    gives this process (the same inputs: the backend, LOCAL_RANK, ACCEL_TORCH_DEVICE)."""
    backend = dist.get_backend()
    device = device_for(True, "nccl" in backend, local_rank())
    barrier(backend, device, group_timeout(), debug=False)
