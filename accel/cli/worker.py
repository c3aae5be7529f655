"""What each rank runs under `accel launch`: the user's script, module or executable, with its traceback recorded.

torch's elastic agent reads the error file that @record writes, so the launcher's failure summary shows
the failing rank's traceback, not just an exit code.

Arguments (from accel.cli.launch.torchrun_argv): `[--call FUNCTION] [--exec] [-m] TARGET [ARGS...]`.
`--call` imports the script (or module) instead of running it as __main__ and calls FUNCTION() (HF's
`--main_training_function`); `--exec` replaces this process with the executable TARGET (`--no_python`), after
the pinning below, which the executable keeps, as it keeps the death signal.

A rank must not outlive its launcher: the elastic agent starts ranks in sessions of their own
(start_new_session), so a launcher killed with SIGKILL signals nobody. Before importing anything slow (torch
takes seconds), the rank asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG), then checks that
its parent is still the launcher (ACCEL_LAUNCHER_PID): a launcher that died before the request leaves the rank
with another parent, and the rank exits at once. `--exec` does the same before it runs the executable, and
imports nothing heavy on the way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """SIGKILL this rank when its parent dies (Linux), and exit now if that happened already."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = os.environ.get("ACCEL_LAUNCHER_PID")
    if launcher and os.getppid() != int(launcher):
        sys.stderr.write(f"accel: the launcher (pid {launcher}) exited before this rank started; exiting\n")
        os._exit(1)


if __name__ == "__main__":  # first, before the imports below (torch) take their seconds
    die_with_launcher()

import importlib  # noqa: E402
import runpy  # noqa: E402

from accel import accelerate_alias  # noqa: E402
from accel.env_vars import get_flag  # noqa: E402


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


def run_python(argv: list[str]) -> None:
    """The script, module or function, its traceback recorded for the launcher."""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def run() -> None:
        if argv[0] == "--call":
            call_function(argv[2:], argv[1])
        else:
            run_target(argv)

    run()


def main(argv: list[str]) -> None:
    pin_to_cpus()
    if argv[0] == "--exec":
        os.execvp(argv[1], argv[1:])
    # The installed .pth does this at interpreter start already; an install without it (a source tree on
    # PYTHONPATH) still gets the switch in every rank.
    accelerate_alias.install_if_asked()
    run_python(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
