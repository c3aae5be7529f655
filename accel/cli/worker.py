"""What each rank runs under `accel launch`: the user's script, module or executable, with its traceback recorded.

torch's elastic agent reads the error file that @record writes, so the launcher's failure summary shows
the failing rank's traceback, not just an exit code.

Arguments (from accel.cli.launch.torchrun_argv): `[--call FUNCTION] [--exec] [-m] TARGET [ARGS...]`.
`--call` imports the script (or module) instead of running it as __main__ and calls FUNCTION() (HF's
`--main_training_function`); `--exec` replaces this process with the executable TARGET (`--no_python`), after
the pinning below, which the executable keeps.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import runpy
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from accel._env import get_flag


def die_with_launcher() -> None:
    """A launcher killed with SIGKILL cannot stop its ranks; the kernel does it for us (Linux only)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def pin_to_cpus() -> None:
    """With ACCEL_CPU_AFFINITY (HF: ACCELERATE_CPU_AFFINITY) set, run on this rank's CPUs only (accel.cpu_affinity):
    a disjoint, NUMA-aware share of the cores for CPU ranks, the CPUs local to its GPU for a GPU rank."""
    if not get_flag("CPU_AFFINITY") or not hasattr(os, "sched_setaffinity"):
        return
    from accel.cpu_affinity import cpu_affinity_for, set_numa_affinity

    local_rank = int(os.environ["LOCAL_RANK"])
    if get_flag("USE_CPU"):  # `--cpu` on a GPU machine: CPU ranks, whatever GPUs are present
        os.sched_setaffinity(0, cpu_affinity_for(local_rank, int(os.environ["LOCAL_WORLD_SIZE"])))
    else:
        set_numa_affinity(local_rank)


def call_function(target: list[str], function: str) -> None:
    """Imports the script or module as HF's TPU launcher does and calls `function()`; argv is the script's."""
    if target[0] == "-m":
        module_name, args = target[1], target[2:]
    else:
        script, args = target[0], target[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        module_name = os.path.splitext(os.path.basename(script))[0]
    module = importlib.import_module(module_name)
    if not callable(getattr(module, function, None)):
        raise AttributeError(f"--main_training_function: {module.__file__} has no function named {function!r}")
    sys.argv = [module.__file__, *args]
    getattr(module, function)()


def run_target(target: list[str]) -> None:
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        return
    script = target[0]
    sys.argv = target
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would set it
    runpy.run_path(script, run_name="__main__")


@record
def main(argv: list[str]) -> None:
    die_with_launcher()
    pin_to_cpus()
    if argv[0] == "--exec":
        os.execvp(argv[1], argv[1:])
    if argv[0] == "--call":
        call_function(argv[2:], argv[1])
        return
    run_target(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
