"""gloo's worker threads at exit: the interpreter finishes only once they are idle.

Below everything that creates a process group served by gloo (`accel.wire.process_group` for `PartialState`, and
`accel.wire.shm_process_group` for the "accel" backend and the default group it shares memory in): each
calls `wait_for_gloo_workers_at_exit()` where the group is created, so the wait is registered on every path, once
per process.
"""

from __future__ import annotations

import atexit
import os
import time

# Name torch gives the worker threads of a gloo process group (c10::setThreadName in ProcessGroupGloo::runLoop).
_GLOO_WORKER = "pt_gloo_runloop"
# How long exit waits for them at most, and how many consecutive idle looks count as idle.
_EXIT_WAIT_S, _IDLE_LOOKS = 2.0, 3

_waits_at_exit = False


def wait_for_gloo_workers_at_exit() -> None:
    """Makes this process run `wait_for_gloo_workers` at exit (registered once, however often it is called)."""
    global _waits_at_exit
    if not _waits_at_exit:
        atexit.register(wait_for_gloo_workers)
        _waits_at_exit = True


def _gloo_worker_states() -> list[str]:
    """The scheduler state (R, S, D, ...) of each gloo worker thread of this process; [] without /proc."""
    states = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return states
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return states


def wait_for_gloo_workers(timeout_s: float = _EXIT_WAIT_S) -> bool:
    """Waits, GIL released, until every gloo worker thread is asleep (three looks 1 ms apart); False at the deadline.

    Why, at exit: a gloo worker drops its reference to a finished collective after waking the caller. A work issued
    during a backward pass (DDP's gradient all-reduce over gloo) holds a Python object (torch stashes a contextvars
    context in thread-local state for the backward), so the worker takes the GIL to release it. A process group
    outlives `destroy_process_group` once DDP has used it (torch keeps it referenced), and when that release comes
    after the interpreter began finalizing, the worker thread is ended from inside C++ and the process aborts
    ("terminate called without an active exception"; seen under CPU load after `accel test` and FSDP2 jobs passed,
    and after a peer died during a gloo collective and the survivor exited). Letting the workers finish while the
    interpreter still runs removes the window.
    """
    deadline = time.monotonic() + timeout_s
    idle = 0
    while idle < _IDLE_LOOKS:
        states = _gloo_worker_states()
        idle = idle + 1 if all(state == "S" for state in states) else 0
        if not states:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
