"""Runs a function on N ranks of a reused pool of spawn processes (gloo on the CPU), for multi-process tests.

    from spawn_pool import run_on_ranks

    def _ranks_agree(value):                      # module level, so the workers can unpickle it
        state = PartialState()
        return state.process_index, value

    def test_ranks_agree():
        assert run_on_ranks(_ranks_agree, 2, "x") == [(0, "x"), (1, "x")]

Starting a worker costs a torch import, so one pool per world size lives for the whole session. The workers
are CPU-only (CUDA is hidden from them), like `torchrun` on a CPU host. For each call the parent picks a free
port, and every worker runs `fn` under the caller's current environment plus RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; afterwards it restores its own environment. Once every rank has
replied, the parent tells the workers to reset the accel singletons and destroy any process group left behind:
a rank that destroyed its group as soon as its own `fn` returned could close gloo connections that a slower
peer is still setting up inside `init_process_group` ("Connection closed by peer").

Fail fast: the first rank that raises (or dies) kills the whole pool, and the call raises `RankFailed` with that
rank's traceback; the next call starts a new pool. A call that does not finish within `timeout` kills the pool
and raises `RanksTimedOut` naming the ranks that did not report, with the Python stack of every thread of each
(faulthandler, on SIGUSR1), so a hang in CI says where it hangs. Workers are daemons that also die with their
parent (PR_SET_PDEATHSIG), so a killed pytest leaves no orphans.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait

STARTUP_TIMEOUT_S = 120.0
STACK_DUMP_WAIT_S = 2.0  # how long the parent waits for a hung worker's faulthandler to write its stacks
_RESET = b"reset"  # parent -> worker, after every rank replied; a task is always a longer pickle
_PR_SET_PDEATHSIG = 1


class RankFailed(RuntimeError):
    """A rank raised or died; `rank` is its index and `details` its formatted traceback (or exit status)."""

    def __init__(self, rank: int, world_size: int, details: str):
        super().__init__(f"rank {rank} of {world_size} failed:\n{details}")
        self.rank = rank
        self.details = details


class RanksTimedOut(TimeoutError):
    """Some ranks did not report within the deadline; `ranks` lists them."""

    def __init__(self, ranks: list[int], world_size: int, timeout: float, stacks: str = ""):
        message = f"ranks {ranks} of {world_size} did not finish within {timeout:g} s"
        super().__init__(f"{message}; where they were:\n{stacks}" if stacks else message)
        self.ranks = ranks


# --- Worker side -------------------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _reset_process_state() -> None:
    import torch.distributed as dist

    from accel.state import AcceleratorState, GradientState, PartialState

    PartialState._reset_state()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_task(task: bytes) -> tuple[str, object]:
    own_env = dict(os.environ)
    try:
        fn, args, kwargs, env = pickle.loads(task)
        os.environ.clear()
        os.environ.update(env)
        result = fn(*args, **kwargs)
        return "ok", pickle.dumps(result)
    except BaseException:  # a failing rank reports anything, pytest.fail and SystemExit included
        return "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(own_env)


def _worker_main(conn: Connection, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # Where SIGUSR1 dumps the stacks: a memfd, which has no name and goes with the process (the parent reads it
    # through /proc/<pid>/fd), so a killed pytest leaves no file behind.
    stack_fd = os.memfd_create("accel-test-stacks")
    faulthandler.register(signal.SIGUSR1, file=stack_fd, all_threads=True)
    # The ranks are CPU processes even on a GPU host: CUDA is hidden before its first (cached) initialization.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    import accel.state  # noqa: F401  (imported once here rather than inside the first task's deadline)

    assert not torch.cuda.is_available()
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for several processes per machine
    conn.send(("ready", stack_fd))
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:
            return
        if not task:
            return
        if task == _RESET:
            _reset_process_state()  # no reply: the next message waits in the pipe behind this one
            continue
        conn.send(_run_task(task))


# --- Parent side -------------------------------------------------------------------------------------------------


class _Pool:
    """`world_size` spawn workers, each with its own pipe; rank i always runs on worker i."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs = []
        self.stack_fds: dict[int, int] = {}  # rank -> the worker's memfd its stacks are dumped to

    def _stack_path(self, rank: int) -> str:
        return f"/proc/{self.procs[rank].pid}/fd/{self.stack_fds[rank]}"

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(child_end, os.getpid()),
                daemon=True,
                name=f"accel-test-rank{rank}-of{self.world_size}",
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        self._collect(self.stack_fds.__setitem__, STARTUP_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, task_for_rank, timeout: float) -> list:
        for rank, conn in enumerate(self.conns):
            conn.send_bytes(task_for_rank(rank))
        results: list = [None] * self.world_size
        self._collect(lambda rank, reply: results.__setitem__(rank, pickle.loads(reply)), timeout)
        for conn in self.conns:
            conn.send_bytes(_RESET)
        return results

    def _collect(self, on_reply, timeout: float) -> None:
        """Waits for one reply per rank; raises on the first error, death or the deadline."""
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        while pending:
            sentinels = {self.procs[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RanksTimedOut(sorted(pending), self.world_size, timeout, self._stacks_of(sorted(pending)))
            ready_ranks = {rank for rank, conn in pending.items() if conn in ready}
            ready_ranks |= {sentinels[item] for item in ready if item in sentinels}
            for rank in sorted(ready_ranks):
                status, payload = self._receive(rank)
                if status == "error":
                    raise RankFailed(rank, self.world_size, payload)
                on_reply(rank, payload)
                del pending[rank]

    def _stacks_of(self, ranks: list[int]) -> str:
        """Every thread's Python stack in each of `ranks`' workers, as faulthandler writes them on SIGUSR1 (the part
        of each worker's dump file written after this call's signal: earlier dumps stay before it)."""
        offsets = {}
        for rank in ranks:
            if rank in self.stack_fds and self.procs[rank].is_alive():
                offsets[rank] = os.stat(self._stack_path(rank)).st_size
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        dumps = []
        for rank in ranks:
            text = "(no dump)"
            if rank in offsets:
                try:
                    with open(self._stack_path(rank)) as dump:
                        dump.seek(offsets[rank])
                        text = dump.read() or text
                except OSError:  # the worker is gone
                    pass
            dumps.append(f"--- rank {rank} (pid {self.procs[rank].pid}) ---\n{text}")
        return "\n".join(dumps)

    def _receive(self, rank: int) -> tuple[str, object]:
        """The reply of `rank`, or an error when its worker died without one."""
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            self.procs[rank].join(1.0)
            return "error", f"the worker process died (exit code {self.procs[rank].exitcode})"

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.reap()

    def request_exit(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass

    def reap(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]


_pools: dict[int, _Pool] = {}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pool(world_size: int) -> _Pool:
    """The live pool for `world_size`, started (and waited for) when there is none."""
    pool = _pools.get(world_size)
    if pool is not None and pool.alive:
        return pool
    if pool is not None:
        pool.kill()
    pool = _pools[world_size] = _Pool(world_size)
    pool.start()
    pool.wait_ready()
    return pool


def run_on_ranks(fn, world_size: int, *args, timeout: float = 60, **kwargs) -> list:
    """Runs `fn(*args, **kwargs)` on ranks 0..world_size-1 of one machine and returns their results by rank.

    `fn`, its arguments and its results must be picklable (`fn` defined at module level). Each rank sees the
    caller's environment plus RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
    MASTER_PORT, so `PartialState()` there sets up a gloo process group.

    Raises:
        RankFailed: a rank raised or died (the first one reported); the pool is killed.
        RanksTimedOut: not every rank finished within `timeout` seconds; the pool is killed.
    """
    pickle.dumps((fn, args, kwargs))  # an unpicklable fn or argument fails here, with pickle's own message
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )

    def task_for_rank(rank: int) -> bytes:
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        return pickle.dumps((fn, args, kwargs, rank_env))

    try:
        return _pool(world_size).run(task_for_rank, timeout)
    except BaseException:
        pool = _pools.pop(world_size, None)
        if pool is not None:
            pool.kill()
        raise


def pool_pids() -> set[int]:
    """The pids of every live pool worker (for the leaked-child-process check)."""
    return {pid for pool in _pools.values() for pid in pool.pids}


def shutdown_pools(grace_s: float = 2.0) -> None:
    """Stops every pool (all workers exit together; stragglers are killed); the next call starts new ones."""
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.request_exit()
    for pool in pools:
        pool.reap(grace_s)


atexit.register(shutdown_pools)
