"""Whether the processes of a group can share memory: the decision of the shared-memory process group
(`accel.wire.shm_process_group`), whose group accel's own collectives use too (`accel.wire.shm_transport`).

Each rank states its facts (`local_facts`), the ranks exchange them, and every rank applies the same rules to the
same list (`why_not`, `oversubscribed`), so all reach the same answer: one host and one /dev/shm (compared, not
assumed from LOCAL_WORLD_SIZE), the same mount and pid namespaces (dead peers are found by pid), the native code
loaded everywhere, and no rank asking for `ACCEL_TRANSPORT=torch`. `ACCEL_TRANSPORT=shm` asks for an error instead
of a fallback. A group that spans hosts can still share memory inside each host (`host_layout`, `shares_a_host`).
Setting up is collective too: `on_every_rank` runs a step on each rank and gives every rank the same outcome. Nothing
here imports torch.distributed or the state: both users sit above it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from typing import Any, Callable

from accel.cpu_affinity import inherited_cpus
from accel.env_vars import get_setting

TRANSPORT_CHOICES = ("auto", "shm", "torch")


def requested_transport() -> str:
    """ACCEL_TRANSPORT: "auto" (default), "shm" or "torch"."""
    choice = (get_setting("TRANSPORT") or "auto").strip().lower()
    if choice not in TRANSPORT_CHOICES:
        raise ValueError(f"ACCEL_TRANSPORT={choice!r}: expected one of {', '.join(TRANSPORT_CHOICES)}")
    return choice


def slot_bytes(default: int) -> int:
    """ACCEL_SHM_SLOT_BYTES (else `default`): the data one round of a shared-memory group carries per rank."""
    value = get_setting("SHM_SLOT_BYTES")
    slot = int(value) if value else default
    if slot < 4096:
        raise ValueError(f"ACCEL_SHM_SLOT_BYTES={value}: a slot holds at least 4096 bytes")
    return slot


@dataclasses.dataclass(frozen=True)
class Facts:
    """What one rank tells the others before they decide together."""

    host: tuple  # equal on every rank of a group that may share memory
    native: bool  # the caller's native code is loaded here
    choice: str  # ACCEL_TRANSPORT
    token: str  # a fresh random name; rank 0's names the group's segments
    cpus: frozenset  # the CPUs this rank may run on
    cpu_quota: int | None


def local_facts(native: bool) -> Facts:
    """This rank's facts; `native` says whether the caller's native code is loaded here."""
    return Facts(host_identity(), native, requested_transport(), secrets.token_hex(16), inherited_cpus(), _cpu_quota())


SPANS_HOSTS = "the processes are not all on one host with a shared /dev/shm"


def why_not(everyone: list[Facts]) -> str | None:
    """Why this group cannot use shared memory among all its ranks (None: it can); the same answer on every rank.
    `SPANS_HOSTS` when that is the only reason: see `shares_a_host`."""
    if any(facts.choice == "torch" for facts in everyone):
        return "ACCEL_TRANSPORT=torch"
    if not all(facts.native for facts in everyone):
        missing = [rank for rank, facts in enumerate(everyone) if not facts.native]
        return f"the native extension is not loaded on process(es) {missing} (see `accel env`)"
    if any(facts.host != everyone[0].host for facts in everyone):
        return SPANS_HOSTS
    return None


def host_layout(everyone: list[Facts]) -> list[list[int]]:
    """The group's ranks by host: each host's ranks in rank order, hosts in the order of their lowest rank (that rank
    leads its host). The same on every rank."""
    hosts: dict[tuple, list[int]] = {}
    for rank, facts in enumerate(everyone):
        hosts.setdefault(facts.host, []).append(rank)
    return list(hosts.values())  # dicts keep insertion order: by lowest rank


def shares_a_host(everyone: list[Facts]) -> bool:
    """Whether some host holds several of the group's ranks: what sharing memory inside each host of a group that
    spans hosts (`why_not` says SPANS_HOSTS) is worth doing for."""
    return any(len(ranks) > 1 for ranks in host_layout(everyone))


def forced(everyone: list[Facts]) -> bool:
    """Some rank asked for shared memory (ACCEL_TRANSPORT=shm): not getting it is an error, not a fallback."""
    return any(facts.choice == "shm" for facts in everyone)


def oversubscribed(everyone: list[Facts]) -> bool:
    """More ranks than the CPUs they can run on together (the same answer on every rank)."""
    cpus = len(frozenset().union(*(facts.cpus for facts in everyone)))
    quotas = [facts.cpu_quota for facts in everyone if facts.cpu_quota is not None]
    return len(everyone) > min([cpus, *quotas])


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


def host_identity() -> tuple:
    """What two processes on one host with one /dev/shm have in common: host name, boot id, /dev/shm's inode, mount
    and pid namespaces (two containers of one machine are two hosts here).

    ACCEL_TEST_HOST_ID (tests and benchmarks only) is added to it: processes of one machine with different values are
    different hosts, so that a job of several "hosts" runs on one machine (two launchers on 127.0.0.2 and 127.0.0.3)."""
    namespaces = tuple(_inode(f"/proc/self/ns/{name}") for name in ("mnt", "pid"))
    identity = (socket.gethostname(), _boot_id(), _inode("/dev/shm"), namespaces)
    test_host = os.environ.get("ACCEL_TEST_HOST_ID")
    return identity if not test_host else (*identity, test_host)


def placement(hosts: list[tuple], rank: int) -> tuple[int, int]:
    """(local rank, local world size) of `rank` given every rank's `host_identity()`: the ranks of one host are
    numbered in rank order, as torchrun numbers them when it starts rank r * n ... r * n + n - 1 on each host."""
    mine = [other for other, host in enumerate(hosts) if host == hosts[rank]]
    return mine.index(rank), len(mine)


def on_every_rank(step: Callable[[], Any], all_gather: Callable[[Any], list]) -> tuple[list | None, str | None]:
    """Runs `step` here and gathers every rank's outcome with `all_gather` (a barrier too): (every rank's result,
    None), or (None, the first failure, naming its rank) on every rank alike. A `RuntimeError` is a failure."""
    result, error = None, None
    try:
        result = step()
    except RuntimeError as failure:
        error = str(failure)
    outcomes = all_gather((result, error))
    failed = [(rank, message) for rank, (_, message) in enumerate(outcomes) if message is not None]
    if failed:
        rank, message = failed[0]
        return None, f"process {rank}: {message}"
    return [outcome for outcome, _ in outcomes], None
