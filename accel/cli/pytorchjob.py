"""A Kubernetes PyTorchJob's pod (Kubeflow's training operator and Trainer): the settings it gives `accel launch`.

Kubeflow runs one launcher per pod and tells each pod, in torchrun's own variables (`PET_<FLAG>`: torchrun reads
them as the defaults of its flags), how many pods (nodes) the job has, this pod's index, the first pod's address and
port, and how many processes a pod runs: `PET_NNODES`, `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`,
`PET_NPROC_PER_NODE`. `accel launch` as a pod's command reads the same variables, so it runs as torchrun would there.
Nothing is read without `PET_NNODES`. A job started for one process per pod without a launcher (`python train.py`,
`MASTER_ADDR` / `WORLD_SIZE` / `RANK` only) needs none of this: `Accelerator()` starts or adopts its group directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NODES = "PET_NNODES"


class PyTorchJobError(ValueError):
    """A PET_* variable that cannot be used; the message names it."""


def in_pytorchjob(environ: Mapping[str, str]) -> bool:
    return environ.get(NODES, "") != ""


def _integer(environ: Mapping[str, str], name: str, minimum: int) -> int:
    value = environ.get(name, "")
    if not value.strip().isdigit() or int(value) < minimum:
        raise PyTorchJobError(f"{name}={value!r}: expected a whole number of at least {minimum}")
    return int(value)


def num_nodes(environ: Mapping[str, str]) -> int:
    """PET_NNODES: `N`, or `N:N` (torchrun's min:max). A range that lets the job grow or shrink is refused: accel
    launch runs a fixed number of machines."""
    value = environ[NODES].strip()
    low, _, high = value.partition(":")
    if high and low != high:
        raise PyTorchJobError(
            f"{NODES}={value!r}: an elastic range of nodes; accel launch runs a fixed number of machines "
            "(give --num_machines, or a PyTorchJob without an elastic policy)"
        )
    return _integer({NODES: low}, NODES, 1)


def settings(environ: Mapping[str, str], wanted: set[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The `wanted` launch settings the pod's PET_* variables give (num_machines, machine_rank, main_process_ip,
    main_process_port, num_processes: PET_NPROC_PER_NODE per machine when it is a number; `auto`, `gpu` or `cpu`
    leave accel's default), and the variable each came from.

    Raises:
        PyTorchJobError: a variable needed is missing or malformed.
    """
    machines = num_nodes(environ)
    readers = {
        "num_machines": (NODES, lambda: machines),
        "machine_rank": ("PET_NODE_RANK", lambda: _rank(environ, machines)),
        "main_process_ip": ("PET_MASTER_ADDR", lambda: _address(environ)),
        "main_process_port": ("PET_MASTER_PORT", lambda: _integer(environ, "PET_MASTER_PORT", 1)),
    }
    values, origins = {}, {}
    for field, (name, read) in readers.items():
        if field not in wanted:
            continue
        if environ.get(name, "") != "":
            values[field], origins[field] = read(), name
        elif machines > 1 and field in ("machine_rank", "main_process_ip"):  # every pod would think it is the first
            raise PyTorchJobError(f"{NODES}={machines} without {name}: give --{field}")
    per_node = environ.get("PET_NPROC_PER_NODE", "")
    if "num_processes" in wanted and per_node.strip().isdigit():
        total_machines = values.get("num_machines", machines)
        values["num_processes"] = _integer(environ, "PET_NPROC_PER_NODE", 1) * total_machines
        origins["num_processes"] = "PET_NPROC_PER_NODE"
    return values, origins


def _rank(environ: Mapping[str, str], machines: int) -> int:
    rank = _integer(environ, "PET_NODE_RANK", 0)
    if rank >= machines:
        raise PyTorchJobError(f"PET_NODE_RANK={rank} is not below {NODES}={machines}")
    return rank


def _address(environ: Mapping[str, str]) -> str:
    return environ["PET_MASTER_ADDR"].strip()
