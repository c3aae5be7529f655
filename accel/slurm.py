"""What a Slurm job's SLURM_* variables say about where this process runs.

Two ways to run under Slurm read them:

- `srun accel launch script.py`, one launcher task per node: `accel launch` takes the number of machines, this
  machine's rank, the first machine's address and the processes per machine from the step (accel/cli/launch.py).
- `srun python script.py`, one task per process: `PartialState` takes each process's rank, local rank and world
  size from the task's variables (`task_environment`).

Both apply only inside a step srun started, which srun marks with SLURM_STEP_NUM_TASKS. The allocation's variables
alone do not count: sbatch's batch script and salloc's shell export SLURM_NTASKS (the whole allocation's tasks) and
the batch script SLURM_PROCID=0, and a single `python script.py` there must stay one process rather than wait for
peers nobody starts. An interactive `srun --pty bash` is a step of one task, so what runs in it stays single too.

Torch-free (the CLI imports it). A variable that is set but cannot be read raises `SlurmError` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

# srun's marker of a step, and its task count (srun also writes it to SLURM_NTASKS for the step's tasks).
STEP_TASKS = "SLURM_STEP_NUM_TASKS"
# Each fact's variables, the step's own first: a step may use only some of the allocation's nodes.
NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
NUM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
# The variables the processes of a torch job read (torchrun exports them; env:// initialization reads them).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The rendezvous port of a job: FIRST_PORT + the job id's last four digits, as Lightning derives it, so two jobs
# sharing a node meet on different ports (below Linux's ephemeral ports, 32768 and up).
FIRST_PORT = 15000
DEFAULT_PORT = 29500  # torch's, when not even a job id is known

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


class SlurmError(ValueError):
    """A SLURM_* variable that cannot be read; the message names it and its value."""


def _error(name: str, value: str, why: str) -> SlurmError:
    return SlurmError(f"{name}={value!r}: {why}")


# --- host lists ----------------------------------------------------------------------------------------------------

# A parsed host list: entries; each entry a sequence of parts, a part either text or a bracket's ranges.
_Range = tuple[int, int, int]  # first, last, digits (zero padding kept: [01-10] is 01, 02, ..., 10)
_Part = str | list[_Range]


def _split_top_level(text: str) -> list[str]:
    """`text` cut at the commas outside brackets: "a[1,3],b" gives ["a[1,3]", "b"]."""
    entries, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ValueError("a bracket closes that was not opened")
        if depth > 1:
            raise ValueError("brackets do not nest in a host list")
        if char == "," and depth == 0:
            entries.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError("a bracket is not closed")
    return [*entries, text[start:]]


def _parse_ranges(inside: str) -> list[_Range]:
    ranges = []
    for item in inside.split(","):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"[{inside}] holds {item!r}, which is not a number or a range like 01-03")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"the range {item!r} ends before it starts")
        ranges.append((int(first), int(last), len(first)))
    return ranges


def _parse_entry(entry: str) -> list[_Part]:
    if not entry:
        raise ValueError("it has an empty entry")
    if any(char.isspace() for char in entry):
        raise ValueError(f"{entry!r} holds a space")
    parts: list[_Part] = []
    for index, piece in enumerate(re.split(r"\[([^\[\]]*)\]", entry)):
        if index % 2:
            parts.append(_parse_ranges(piece))
        elif "[" in piece or "]" in piece:
            raise ValueError(f"{entry!r} has an unmatched bracket")
        elif piece:
            parts.append(piece)
    return parts


def _parse_hostlist(hostlist: str, name: str) -> list[list[_Part]]:
    try:
        return [_parse_entry(entry) for entry in _split_top_level(hostlist.strip())]
    except ValueError as error:
        raise _error(name, hostlist, f"not a Slurm host list ({error})") from None


def _values(part: _Part) -> Iterator[str]:
    if isinstance(part, str):
        yield part
        return
    for first, last, digits in part:
        for number in range(first, last + 1):
            yield str(number).zfill(digits)


def _hosts(parts: list[_Part], prefix: str = "") -> Iterator[str]:
    """Every host of one entry: the cartesian product of its parts, the first part varying slowest."""
    if not parts:
        yield prefix
        return
    for value in _values(parts[0]):
        yield from _hosts(parts[1:], prefix + value)


def expand_hostlist(hostlist: str, name: str = "host list") -> list[str]:
    """The host names of a Slurm host list, in Slurm's order.

    Slurm writes "node01", "node[01-03,07]" (zero padding kept), "rack[1-2]-node[01-02]" (every combination, the
    first bracket varying slowest) and several such entries separated by commas: "a[1-2],b3".

    Args:
        hostlist: The list, as Slurm writes it in SLURM_JOB_NODELIST.
        name: What to call it in an error (the variable it came from).

    Raises:
        SlurmError: `hostlist` is malformed (unbalanced brackets, an empty entry, a range that is not numbers or
            ends before it starts); the message names `name` and the value.
    """
    return [host for entry in _parse_hostlist(hostlist, name) for host in _hosts(entry)]


def first_host(hostlist: str, name: str = "host list") -> str:
    """The first host of a Slurm host list (the whole list is checked, but not expanded).

    Raises:
        SlurmError: as `expand_hostlist`.
    """
    return next(_hosts(_parse_hostlist(hostlist, name)[0]))


# --- reading the variables -------------------------------------------------------------------------------------------


def _lookup(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, value) of the first of `names` that is set and not empty."""
    return next(((name, environ[name]) for name in names if environ.get(name, "") != ""), None)


def _required(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str]:
    found = _lookup(environ, names)
    if found is None:
        raise SlurmError(f"{' / '.join(names)} is not set, though srun started this process ({STEP_TASKS} is set)")
    return found


def _integer(name: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _error(name, value, "not an integer") from None
    if number < minimum:
        raise _error(name, value, f"must be at least {minimum}")
    return number


def _read_int(environ: Mapping[str, str], names: tuple[str, ...], minimum: int) -> tuple[str, int]:
    name, value = _required(environ, names)
    return name, _integer(name, value, minimum)


def tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """The number of tasks on each node of a step, from Slurm's compact form: "2(x3),1" is [2, 2, 2, 1].

    Raises:
        SlurmError: `value` is not in that form; the message names `name`.
    """
    counts = []
    for item in value.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise _error(name, value, f"{item!r} is not a task count like 2 or 2(x3)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """Whether srun started this process (sbatch's batch script and salloc's shell are no step of srun's)."""
    return environ.get(STEP_TASKS, "") != ""


def job_port(environ: Mapping[str, str]) -> int:
    """The job's rendezvous port: FIRST_PORT + the last four digits of SLURM_JOB_ID (DEFAULT_PORT without one), the
    same on every node of the job and different for jobs sharing a node (unless their ids end alike)."""
    value = environ.get("SLURM_JOB_ID", "")
    if value == "":
        return DEFAULT_PORT
    return FIRST_PORT + _integer("SLURM_JOB_ID", value, 0) % 10000


def num_nodes(environ: Mapping[str, str]) -> tuple[str, int]:
    """(variable, count) of the step's nodes."""
    return _read_int(environ, NUM_NODES, 1)


def node_rank(environ: Mapping[str, str]) -> tuple[str, int]:
    """(variable, index) of this node among the step's nodes: SLURM_NODEID, checked against their number."""
    name, rank = _read_int(environ, ("SLURM_NODEID",), 0)
    count_name, count = num_nodes(environ)
    if rank >= count:
        raise SlurmError(f"SLURM_NODEID={rank} is not below {count_name}={count}")
    return name, rank


def first_node(environ: Mapping[str, str]) -> tuple[str, str]:
    """(variable, host) of the step's first node: where rank 0 runs (Slurm places task 0 on it)."""
    name, hostlist = _required(environ, NODELIST)
    return name, first_host(hostlist, name)


def gpus_on_node(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """(SLURM_GPUS_ON_NODE, count) when Slurm gave this node's step GPUs; None when it gave none."""
    value = environ.get("SLURM_GPUS_ON_NODE", "")
    count = _integer("SLURM_GPUS_ON_NODE", value, 0) if value != "" else 0
    return ("SLURM_GPUS_ON_NODE", count) if count else None


def check_one_task_per_node(environ: Mapping[str, str]) -> None:
    """`srun accel launch` makes each task one machine: refuses a step with more tasks than nodes.

    Raises:
        SlurmError: srun started several launchers on a node, naming the variables and what to run instead.
    """
    tasks_name, tasks = _read_int(environ, (STEP_TASKS,), 1)
    nodes_name, nodes = num_nodes(environ)
    if tasks != nodes:
        raise SlurmError(
            f"{tasks_name}={tasks} with {nodes_name}={nodes}: `srun accel launch` starts the processes of "
            "one machine per task, so it needs one task per node (srun --ntasks-per-node=1); to start "
            "one task per process instead, run the script itself: srun python script.py"
        )


# --- one srun task per process -------------------------------------------------------------------------------------


def task_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The torch variables of a process srun started as one task of several (`srun python script.py`).

    RANK is SLURM_PROCID, LOCAL_RANK SLURM_LOCALID, WORLD_SIZE the step's task count (SLURM_STEP_NUM_TASKS, which
    srun also writes to SLURM_NTASKS), LOCAL_WORLD_SIZE this node's entry of SLURM_STEP_TASKS_PER_NODE (index
    SLURM_NODEID); MASTER_ADDR is the step's first node and MASTER_PORT the job's port (`job_port`), unless either is
    set already.

    Returns:
        Those variables, or None when they do not apply: a launcher (torchrun, `accel launch`) set RANK,
        WORLD_SIZE or LOCAL_RANK already; srun did not start this process; or the step has one task.

    Raises:
        SlurmError: a variable needed is missing or cannot be read, or they contradict each other.
    """
    if any(name in environ for name in LAUNCHER_VARIABLES) or not in_srun_step(environ):
        return None
    world_name, world_size = _read_int(environ, (STEP_TASKS,), 1)
    if world_size == 1:
        return None
    rank_name, rank = _read_int(environ, ("SLURM_PROCID",), 0)
    if rank >= world_size:
        raise SlurmError(f"{rank_name}={rank} is not below {world_name}={world_size}")
    local_name, local_rank = _read_int(environ, ("SLURM_LOCALID",), 0)
    _, node = node_rank(environ)
    counts_name, counts = _required(environ, TASKS_PER_NODE)
    per_node = tasks_per_node(counts, counts_name)
    if node >= len(per_node) or local_rank >= per_node[node]:
        raise SlurmError(f"{local_name}={local_rank} on node SLURM_NODEID={node} does not fit {counts_name}={counts!r}")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_node[node]),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_node(environ)[1],
        "MASTER_PORT": environ.get("MASTER_PORT") or str(job_port(environ)),
    }
