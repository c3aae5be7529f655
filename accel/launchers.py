"""Running a training function on several processes from a notebook (`notebook_launcher`) or a test (`debug_launcher`).

Both fork: a function defined in a notebook cell cannot be pickled for spawn. Forking is only safe while the parent
has not touched CUDA, has no process group and holds no `AcceleratorState`, so both launchers refuse otherwise, with
a message saying what to change. `notebook_launcher` hands the processes to torch's elastic agent (rendezvous,
monitoring, restarts and error files are torch's); `debug_launcher` forks CPU processes joined by gloo through a
file store, as HF Accelerate's does.

The parent is left as it was found: its environment variables and signal handlers (which torch's elastic agent
replaces) are restored, and the elastic agent's logs and error files go to a directory removed afterwards.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import uuid
from contextlib import contextmanager
from functools import wraps
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from accel.env_vars import MIXED_PRECISIONS
from accel.environment import get_free_port, patch_environment
from accel.state import AcceleratorState, DistributedType, GradientState, PartialState
from accel.wire.gloo_workers import wait_for_gloo_workers_at_exit

__all__ = [
    "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION",
    "PrepareForLaunch",
    "debug_launcher",
    "notebook_launcher",
    "test_launch",
]

# HF's constant: the torch version whose elastic LaunchConfig takes `log_line_prefix_template`. accel needs torch
# >= 2.4, so notebook_launcher always passes it.
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"

# The signals torch's elastic agent installs its own handlers for (LaunchConfig.signals_to_handle).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_CUDA_REINIT_ERROR = "Cannot re-initialize CUDA in forked subprocess"
_CUDA_ADVICE = (
    "CUDA has been initialized in this process before the `notebook_launcher` could fork its processes, and a "
    "forked process cannot use it. Restart the notebook and make sure no cell before the launch touches CUDA "
    "(a model or tensor moved to the GPU, `torch.cuda.*` calls, an `Accelerator()`, or an import that does so); "
    "do all of that inside the launched function."
)


# --- Guarding the parent -----------------------------------------------------------------------------------------


@contextmanager
def _environ_restored() -> Iterator[None]:
    """Afterwards, os.environ is as before: torch's elastic agent exports variables of its own in this process."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in os.environ.keys() - before.keys():
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """Restores the handlers of the signals torch's elastic agent takes over (Jupyter's SIGINT among them)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set, and are only replaced by the agent, on the main thread
        return
    signals = [getattr(signal, name) for name in _AGENT_SIGNALS if hasattr(signal, name)]
    handlers = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                signal.signal(sig, handler)


def _gpu_count() -> int:
    """The number of CUDA devices, counted through NVML so that the parent stays fork-safe (no cuInit)."""
    return torch.cuda.device_count()


def _check_can_fork() -> None:
    """Raises when forking now would hand the processes state they cannot use."""
    if torch.cuda.is_initialized():
        raise RuntimeError(_CUDA_ADVICE)
    if AcceleratorState._shared_state:
        raise ValueError(
            "To launch a multi-process training from your notebook, the `Accelerator` should only be initialized "
            "inside your training function. Restart your notebook and make sure no cells initializes an "
            "`Accelerator`."
        )
    _check_no_process_group()


def _check_no_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "A torch.distributed process group is already initialized in this process, and forked processes "
            "cannot share it. Call `torch.distributed.destroy_process_group()` first, or create the group inside "
            "the launched function."
        )


def _check_mixed_precision(mixed_precision: str) -> str:
    value = str(mixed_precision).strip().lower()
    if value not in MIXED_PRECISIONS:
        raise ValueError(f"Unknown mixed_precision mode: {mixed_precision!r}. Choose between {list(MIXED_PRECISIONS)}.")
    return value


def _rendezvous(
    use_port: str | int, master_addr: str, num_nodes: int, rdzv_backend: str, rdzv_endpoint: str, rdzv_id: str
) -> tuple[str, str, str]:
    """(backend, endpoint, id) of the rendezvous.

    use_port="0" (one machine) lets the rendezvous store bind port 0 itself: the c10d rendezvous at
    `master_addr:0`, whose store the ranks then share, with a fresh id. Picking a free port first and
    binding it later (HF's way) leaves a window in which another process can take the port.
    """
    if rdzv_endpoint:
        return rdzv_backend, rdzv_endpoint, rdzv_id
    if str(use_port) != "0":
        return rdzv_backend, f"{master_addr}:{int(use_port)}", rdzv_id
    if num_nodes > 1:
        raise ValueError("use_port='0' picks a port on this machine only; give the port all machines use.")
    return "c10d", f"{master_addr}:0", uuid.uuid4().hex if rdzv_id == "none" else rdzv_id


# --- What the forked processes run -------------------------------------------------------------------------------


def _forget_inherited_state() -> None:
    """Drops the accel singletons a fork copied from the parent, so each process resolves its own rank."""
    PartialState._reset_state()
    AcceleratorState._reset_state()
    GradientState._reset_state()


def _fresh_state_entrypoint(function: Callable) -> Callable:
    @wraps(function)  # the elastic agent names the entrypoint after `__name__`
    def entrypoint(*args):
        _forget_inherited_state()
        return function(*args)

    return entrypoint


# --- notebook_launcher -------------------------------------------------------------------------------------------


def test_launch() -> None:
    """Checks that a `PartialState` can be created in this process (HF's launcher self-test)."""
    PartialState()


def _launch_config(
    num_processes: int,
    num_nodes: int,
    node_rank: int,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_conf: dict | None,
    rdzv_id: str,
    max_restarts: int,
    monitor_interval: float,
    log_line_prefix_template: str | None,
    log_dir: str,
):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    rdzv_configs = dict(rdzv_conf or {})  # LaunchConfig adds a timeout to it: the caller's dict stays as given
    if rdzv_backend == "static":
        rdzv_configs["rank"] = node_rank
    fields = dict(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        run_id=rdzv_id,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="fork",
        log_line_prefix_template=log_line_prefix_template,
    )
    if not hasattr(torch, "numa"):
        return LaunchConfig(**fields)
    # Without numa_options, LaunchConfig probes torch.cuda.is_available() (cuInit), which leaves every forked
    # process unable to use CUDA; a placeholder skips the probe, and None afterwards skips NUMA binding.
    from torch.numa.binding import AffinityMode, NumaOptions

    config = LaunchConfig(**fields, numa_options=NumaOptions(AffinityMode.NODE))
    config.numa_options = None
    return config


def _run_elastic(function: Callable, args: tuple, config_fields: dict) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    with tempfile.TemporaryDirectory(prefix="accel-notebook-") as log_dir, _kept_signal_handlers():
        config = _launch_config(**config_fields, log_dir=log_dir)
        try:
            elastic_launch(config=config, entrypoint=_fresh_state_entrypoint(function))(*args)
        except ChildFailedError as exc:
            if _CUDA_REINIT_ERROR in str(exc):
                raise RuntimeError(_CUDA_ADVICE) from exc
            raise


def _run_in_process(function: Callable, args: tuple, mixed_precision: str) -> None:
    device = "one GPU" if _gpu_count() > 0 else "CPU"
    print(f"Launching training on {device}.")
    with patch_environment(ACCEL_MIXED_PRECISION=mixed_precision):
        function(*args)


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> None:
    """Runs `function(*args)` on `num_processes` forked processes per machine, from a notebook or a script.

    Each process finds its rank in the environment torch's elastic agent sets (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), plus ACCEL_MIXED_PRECISION, ACCEL_FORK_LAUNCHED=1 and, without GPUs, ACCEL_USE_CPU=1:
    an `Accelerator()` or `PartialState()` created inside `function` joins the group. With one process (or
    `num_processes=None` on a machine without GPUs) `function` simply runs here.

    Nothing in this process may have touched CUDA, created an `Accelerator` or a process group before the call:
    forked processes could not use them, so the launcher refuses.

    Args:
        function: The training function; defined anywhere, a notebook cell included (it is not pickled).
        args: The positional arguments `function` receives.
        num_processes: Processes on this machine; None means one per GPU (or one process without GPUs).
        mixed_precision: "no", "fp16", "bf16" or "fp8", exported as ACCEL_MIXED_PRECISION.
        use_port: The rendezvous port on node 0; "0" lets the rendezvous bind a free one (single machine only;
            it then runs the c10d rendezvous whatever `rdzv_backend` says).
        master_addr: The address of node 0.
        node_rank: This machine's index, below `num_nodes`.
        num_nodes: The number of machines.
        rdzv_backend: "static" (the default) or "c10d".
        rdzv_endpoint: host:port of the rendezvous; default `master_addr:use_port`.
        rdzv_conf: Extra rendezvous settings, e.g. {"timeout": seconds} (torch's default is 900 s).
        rdzv_id: The job's id for the rendezvous.
        max_restarts: How many times the agent restarts all processes after a failure before giving up.
        monitor_interval: Seconds between the agent's checks of its processes.
        log_line_prefix_template: The prefix of each process's output lines, e.g. "[${rank}]: ".

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: A process failed (after `max_restarts`
            restarts); the message holds that process's exception and traceback.
        RuntimeError: CUDA or a process group was initialized here before the launch.
        ValueError: An `Accelerator` exists here already, or an argument is out of range.

    Example:
        ```python
        def train(learning_rate):
            accelerator = Accelerator()  # rank 0 and rank 1 each build their own
            ...

        notebook_launcher(train, args=(1e-3,), num_processes=2, mixed_precision="bf16")
        ```
    """
    mixed_precision = _check_mixed_precision(mixed_precision)
    gpus = _gpu_count()
    if num_processes is None:
        num_processes = max(gpus, 1)
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes}: launch at least one process.")
    if not 0 <= node_rank < num_nodes:
        raise ValueError("The node_rank must be less than the number of nodes.")
    if num_processes == 1 and num_nodes == 1:
        return _run_in_process(function, args, mixed_precision)
    _check_can_fork()
    rdzv_backend, rdzv_endpoint, rdzv_id = _rendezvous(
        use_port, master_addr, num_nodes, rdzv_backend, rdzv_endpoint, rdzv_id
    )
    child_env = {"ACCEL_MIXED_PRECISION": mixed_precision, "ACCEL_FORK_LAUNCHED": "1"}
    if gpus == 0:
        child_env["ACCEL_USE_CPU"] = "1"
    print(f"Launching training on {num_processes} {'GPUs' if gpus else 'CPU processes'}.")
    config_fields = dict(
        num_processes=num_processes,
        num_nodes=num_nodes,
        node_rank=node_rank,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
    )
    with _environ_restored(), patch_environment(**child_env):
        _run_elastic(function, args, config_fields)


# --- debug_launcher ----------------------------------------------------------------------------------------------


def _debug_worker(index: int, function: Callable, args: tuple, store_path: str, world_size: int) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))  # this forked process's own environment
    _forget_inherited_state()
    store = dist.FileStore(store_path, world_size)
    wait_for_gloo_workers_at_exit()
    dist.init_process_group("gloo", rank=index, world_size=world_size, store=store)
    try:
        function(*args)
    finally:
        dist.destroy_process_group()


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Runs `function(*args)` on `num_processes` forked CPU processes joined by gloo; for tests and debugging.

    Each process already has the default process group (gloo, through a file store) when `function` starts;
    `PartialState()` inside it reports `MULTI_CPU` and the process's rank. Not meant for real trainings.

    Args:
        function: The function to run; it is not pickled, so a local function works too.
        args: The positional arguments `function` receives.
        num_processes: The number of processes.

    Raises:
        torch.multiprocessing.ProcessRaisedException: A process raised; the message holds its traceback. The
            other processes are terminated.

    Example:
        ```python
        def check():
            state = PartialState()
            total = torch.tensor([state.process_index + 1])
            torch.distributed.all_reduce(total)  # rank 0 and rank 1: tensor([3])

        debug_launcher(check, num_processes=2)
        ```
    """
    from torch.multiprocessing import start_processes

    _check_no_process_group()
    with tempfile.TemporaryDirectory(prefix="accel-debug-") as store_dir:
        env = {
            "WORLD_SIZE": str(num_processes),
            "LOCAL_WORLD_SIZE": str(num_processes),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(get_free_port("127.0.0.1")),
            "ACCEL_MIXED_PRECISION": "no",
            "ACCEL_USE_CPU": "1",
            "ACCEL_FORK_LAUNCHED": "1",
            "GLOO_SOCKET_IFNAME": "lo",  # gloo's hostname-based interface choice is unreliable on CI machines
        }
        worker_args = (function, tuple(args), os.path.join(store_dir, "store"), num_processes)
        with patch_environment(**env):
            start_processes(_debug_worker, args=worker_args, nprocs=num_processes, start_method="fork")


# --- PrepareForLaunch --------------------------------------------------------------------------------------------

# The distributed types whose processes find their rank in RANK / LOCAL_RANK (set here from the process index).
_RANKED_TYPES = {
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NEURON,
}


class PrepareForLaunch:
    """Wraps `launcher` for `torch.multiprocessing.start_processes`: the process's index becomes its rank.

    HF Accelerate's class, for scripts that start their own processes. In a ranked distributed type
    (MULTI_GPU, MULTI_CPU, ...), process `index` gets LOCAL_RANK=index and RANK=NPROC * NODE_RANK + index (NPROC:
    processes per machine, default 1; NODE_RANK default 0), so an `Accelerator()` in `launcher` joins the group
    that WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by the caller) describe. With `debug`, the process joins a
    gloo group through the file store at ACCEL_DEBUG_RDV_FILE (HF: ACCELERATE_DEBUG_RDV_FILE) instead. Either
    way ACCEL_FORK_LAUNCHED=1 is set. The environment changed is the launched process's own.

    Args:
        launcher: the function to run as `launcher(*args)`; module-level, so that spawn can pickle it.
        distributed_type: a DistributedType or its name.
        debug: join a gloo group through a file store (for tests).

    Example:
        ```python
        with patch_environment(world_size=2, master_addr="127.0.0.1", master_port="29500"):
            torch.multiprocessing.start_processes(PrepareForLaunch(train, "MULTI_CPU"), args=(config,), nprocs=2)
        ```
    """

    def __init__(self, launcher: Callable, distributed_type: DistributedType | str = "NO", debug: bool = False):
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args) -> None:
        if self.debug:
            world_size = int(os.environ["WORLD_SIZE"])
            store_path = os.environ.get("ACCEL_DEBUG_RDV_FILE") or os.environ["ACCELERATE_DEBUG_RDV_FILE"]
            wait_for_gloo_workers_at_exit()
            dist.init_process_group(
                "gloo", rank=index, world_size=world_size, store=dist.FileStore(store_path, world_size)
            )
        elif self.distributed_type in _RANKED_TYPES:
            node_rank, per_node = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("NPROC", 1))
            os.environ.update(LOCAL_RANK=str(index), RANK=str(per_node * node_rank + index))
        os.environ["ACCEL_FORK_LAUNCHED"] = "1"
        self.launcher(*args)
