"""Pinning each process of a machine to CPU cores of its own, NUMA-aware (`accel launch --enable_cpu_affinity`,
HF Accelerate's `set_numa_affinity`).

`cpu_affinity_for(local_rank, local_world_size)` splits the CPUs this process was started with (its inherited
affinity, e.g. a cgroup's cpuset or `taskset`) into disjoint sets, one per local rank (with more ranks than CPUs,
ranks share CPUs round-robin, one CPU each):

- NUMA nodes are read from /sys/devices/system/node; each rank's CPUs lie in one node when there are at least
  as many ranks as nodes (ranks are spread over the nodes in proportion to their CPUs, consecutive ranks in the
  same node), and a rank gets whole nodes when there are fewer ranks than nodes.
- Inside a node, a rank gets whole physical cores (both hyperthreads of a core, read from each CPU's
  `topology/thread_siblings_list`), unless there are more ranks than cores in the node.
- Without sysfs (not Linux) all CPUs form one node and every CPU is its own core.

`set_numa_affinity(local_process_index)` applies it to the calling process. With a CUDA GPU for that process, it
pins to the CPUs local to the GPU instead (HF's behaviour, which reads them through pynvml; accel reads the GPU's
PCI address from nvidia-smi and its `local_cpulist` from sysfs, so no extra package is needed). HF does nothing
on machines without a CUDA GPU; accel pins CPU ranks too.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from accel.availability import is_cuda_available
from accel.env_vars import get_flag
from accel.environment import SETTING_PREFIXES, get_cpu_distributed_information, parse_flag_from_env, query_gpus

logger = logging.getLogger(__name__)

SYSFS_CPU_ROOT = Path("/sys/devices/system")
SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")

Core = tuple[int, ...]  # the logical CPUs (hyperthreads) of one physical core


def parse_cpu_list(text: str) -> list[int]:
    """Reads a sysfs CPU list such as "0-3,8,10-11" (empty: no CPU)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part.strip():
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _read_cpu_list(path: Path) -> list[int] | None:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return None


@functools.cache
def inherited_cpus() -> frozenset[int]:
    """The CPUs this process was allowed to run on when first asked (before accel pinned it)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def numa_nodes(allowed: frozenset[int], root: Path = SYSFS_CPU_ROOT) -> list[list[int]]:
    """The CPUs of `allowed` grouped by NUMA node (nodes without any of them left out), in node order."""
    node_dirs = sorted(root.glob("node/node[0-9]*"), key=lambda path: int(path.name[4:]))
    nodes = []
    for node_dir in node_dirs:
        cpus = _read_cpu_list(node_dir / "cpulist") or []
        nodes.append(sorted(allowed.intersection(cpus)))
    nodes = [node for node in nodes if node]
    placed = {cpu for node in nodes for cpu in node}
    if len(placed) < len(allowed):  # CPUs sysfs does not place (no NUMA support): one more node
        nodes.append(sorted(allowed - placed))
    return nodes


def physical_cores(cpus: list[int], root: Path = SYSFS_CPU_ROOT) -> list[Core]:
    """`cpus` grouped into physical cores (hyperthread siblings together), ordered by their first CPU."""
    members = set(cpus)
    cores: dict[int, Core] = {}
    for cpu in cpus:
        siblings = _read_cpu_list(root / f"cpu/cpu{cpu}/topology/thread_siblings_list") or [cpu]
        core = tuple(sorted(members.intersection(siblings) | {cpu}))
        cores.setdefault(core[0], core)
    return [cores[first] for first in sorted(cores)]


def _split(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` consecutive runs whose lengths differ by at most one (longer runs first)."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _ranks_per_node(node_sizes: list[int], world_size: int) -> list[int]:
    """How many ranks each node gets: one each, then every further rank to the node with the most CPUs per rank
    (the earliest node on ties), so that CPUs per rank are as even as the nodes allow."""
    counts = [1] * len(node_sizes)
    for _ in range(world_size - len(node_sizes)):
        best = max(range(len(node_sizes)), key=lambda i: (node_sizes[i] / counts[i], -i))
        counts[best] += 1
    return counts


def _split_node(cores: list[Core], ranks: int) -> list[set[int]]:
    """A node's CPUs cut into `ranks` disjoint sets: whole physical cores when there are enough of them."""
    if ranks <= len(cores):
        return [{cpu for core in run for cpu in core} for run in _split(cores, ranks)]
    cpus = [cpu for core in cores for cpu in core]
    return [set(run) for run in _split(cpus, ranks)]


def plan_affinity(nodes: list[list[Core]], world_size: int) -> list[set[int]]:
    """Disjoint CPU sets, one per local rank, for a machine whose NUMA nodes hold the given physical cores.

    Args:
        nodes: Per NUMA node, its physical cores (each a tuple of logical CPUs).
        world_size: The number of ranks on the machine.

    Returns:
        `world_size` non-empty sets of CPUs, in rank order, pairwise disjoint unless there are more ranks than
        CPUs: then rank `r` gets the `r % CPUs`-th CPU alone (ranks share CPUs round-robin), with a warning.

    Raises:
        ValueError: `world_size` below 1.
    """
    cpus = [cpu for cores in nodes for core in cores for cpu in core]
    if world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {world_size}")
    if world_size > len(cpus):
        logger.warning("%d processes share %d CPUs: CPU affinity cannot keep them apart", world_size, len(cpus))
        return [{cpus[rank % len(cpus)]} for rank in range(world_size)]
    if world_size <= len(nodes):
        return [{cpu for cores in run for core in cores for cpu in core} for run in _split(nodes, world_size)]
    counts = _ranks_per_node([sum(len(core) for core in cores) for cores in nodes], world_size)
    return [cpus for cores, ranks in zip(nodes, counts) for cpus in _split_node(cores, ranks)]


def cpu_affinity_for(local_rank: int, local_world_size: int) -> set[int]:
    """The CPUs local rank `local_rank` of `local_world_size` should run on: disjoint from every other local
    rank's (unless there are more ranks than CPUs), within one NUMA node where possible, whole physical cores
    where possible (see the module docstring).

    Pure: reads the machine's topology and this process's inherited affinity, changes nothing. The same call in
    every rank (or in the launcher, once per rank) gives consistent sets.

    Args:
        local_rank: The rank's index on this machine, `0 <= local_rank < local_world_size`.
        local_world_size: The number of ranks on this machine.

    Raises:
        ValueError: `local_rank` out of range.

    Example (a machine with 2 NUMA nodes of 8 cores, 2 hyperthreads each: CPUs 0-7 + 16-23 and 8-15 + 24-31)::

        cpu_affinity_for(0, 2)   # {0, ..., 7, 16, ..., 23}: node 0
        cpu_affinity_for(1, 4)   # {4, 5, 6, 7, 20, 21, 22, 23}: the second half of node 0's cores
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank must be in 0..{local_world_size - 1}, got {local_rank}")
    allowed = inherited_cpus()
    nodes = [physical_cores(cpus) for cpus in numa_nodes(allowed)]
    return plan_affinity(nodes, local_world_size)[local_rank]


# --- applying it -------------------------------------------------------------------------------------------------


def _visible_gpu(local_process_index: int, gpus: list[list[str]]) -> list[str] | None:
    """The nvidia-smi row (index, uuid, pci.bus_id) of the process's GPU, honouring CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [entry.strip() for entry in visible.split(",")] if visible is not None else [row[0] for row in gpus]
    if local_process_index >= len(entries):
        return None
    entry = entries[local_process_index]
    return next(
        (row for row in gpus if entry == row[0] or (entry.startswith("GPU-") and row[1].startswith(entry))), None
    )


def gpu_local_cpus(local_process_index: int, root: Path = SYSFS_PCI_DEVICES) -> set[int] | None:
    """The CPUs (of the inherited affinity) attached to the process's NVIDIA GPU, or None when unknown.

    The GPU is found by nvidia-smi (so CUDA is not initialized) in nvidia-smi's PCI order, as HF's pynvml lookup
    does; CUDA orders devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so set that on machines with
    mixed GPUs.
    """
    try:
        row = _visible_gpu(local_process_index, query_gpus("index", "uuid", "pci.bus_id"))
    except Exception:  # no nvidia-smi or no driver
        return None
    if row is None:
        return None
    domain, _, rest = row[2].lower().partition(":")
    cpus = _read_cpu_list(root / f"{int(domain, 16):04x}:{rest}" / "local_cpulist")
    local = inherited_cpus().intersection(cpus or [])
    return set(local) or None


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pins this process to its CPUs now, even if it was pinned before (see `set_numa_affinity`).

    Args:
        local_process_index: The process's index on this machine.
        verbose: Log the CPUs chosen; default: debug mode (ACCEL_DEBUG_MODE / ACCELERATE_DEBUG_MODE).
    """
    if verbose is None:
        verbose = any(parse_flag_from_env(prefix + "DEBUG_MODE") for prefix in SETTING_PREFIXES)
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("CPU affinity is not supported on this system; process %d is not pinned", local_process_index)
        return
    # `accel launch --cpu` (ACCEL_USE_CPU) on a GPU machine runs CPU ranks: they get their share of the CPUs.
    cpus = gpu_local_cpus(local_process_index) if is_cuda_available() and not get_flag("USE_CPU") else None
    if cpus is None:
        cpus = cpu_affinity_for(local_process_index, get_cpu_distributed_information().local_world_size)
    os.sched_setaffinity(0, cpus)
    if verbose:
        logger.info("Assigning %d cpu cores to process %d: %s", len(cpus), local_process_index, sorted(cpus))


@functools.lru_cache
def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pins this process to the CPUs meant for it: those local to its CUDA GPU when it has one, else its own
    disjoint, NUMA-aware share of the machine (`cpu_affinity_for` with the LOCAL_WORLD_SIZE the launcher set).

    Done once per process (cached, as in HF); `override_numa_affinity` pins again.

    Args:
        local_process_index: The process's index on this machine.
        verbose: Log the CPUs chosen; default: debug mode (ACCEL_DEBUG_MODE / ACCELERATE_DEBUG_MODE).
    """
    override_numa_affinity(local_process_index=local_process_index, verbose=verbose)
