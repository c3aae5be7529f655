"""The spawn pool of tests/spawn_pool.py: results per rank, fail-fast, deadlines, reuse and a clean env per task."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import spawn_pool
import torch.distributed as dist
from spawn_pool import RankFailed, RanksTimedOut, run_on_ranks


def _identity(*args, **kwargs):
    return os.getpid(), int(os.environ["RANK"]), args, kwargs


def _fail_on(bad_rank: int):
    if int(os.environ["RANK"]) == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    time.sleep(30)  # the others would block here; the pool must not wait for them


def _hang_on(slow_rank: int):
    if int(os.environ["RANK"]) == slow_rank:
        time.sleep(60)
    return "done"


def _die_on(bad_rank: int):
    if int(os.environ["RANK"]) == bad_rank:
        os._exit(3)
    time.sleep(30)


def _leave_dirty_state():
    os.environ["ACCEL_TEST_LEAK"] = "1"
    dist.init_process_group("gloo")
    from accel.state import PartialState

    PartialState()
    return os.environ["MASTER_PORT"]


def _observe_state():
    from accel.state import PartialState

    return os.environ.get("ACCEL_TEST_LEAK"), dist.is_initialized(), PartialState._shared_state == {}


def _read_env(name: str):
    return os.environ.get(name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_are_returned_by_rank(world_size):
    results = run_on_ranks(_identity, world_size, "a", key=3)
    assert [rank for _, rank, _, _ in results] == list(range(world_size))
    assert all(args == ("a",) and kwargs == {"key": 3} for _, _, args, kwargs in results)
    assert len({pid for pid, _, _, _ in results}) == world_size


@pytest.mark.timeout(120)
def test_pool_is_reused_across_calls():
    first = [pid for pid, *_ in run_on_ranks(_identity, 2)]
    second = [pid for pid, *_ in run_on_ranks(_identity, 2)]
    assert first == second


@pytest.mark.timeout(120)
def test_a_raising_rank_fails_the_call_fast_with_its_traceback():
    pids = [pid for pid, *_ in run_on_ranks(_identity, 2)]  # a warm pool: the timing measures the failure only
    started = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_on_ranks(_fail_on, 2, 1, timeout=60)
    assert time.monotonic() - started < 30  # fail-fast: far below the call's timeout
    assert failure.value.rank == 1
    assert "rank 1 of 2" in str(failure.value)
    assert "ValueError: boom from rank 1" in failure.value.details
    assert "_fail_on" in failure.value.details  # the formatted traceback, not just the message
    assert not any(_alive(pid) for pid in pids)  # the whole pool was killed, rank 0 included
    assert [rank for _, rank, _, _ in run_on_ranks(_identity, 2)] == [0, 1]


@pytest.mark.timeout(120)
def test_a_dying_rank_fails_the_call_fast():
    run_on_ranks(_identity, 2)
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 of 2 failed") as failure:
        run_on_ranks(_die_on, 2, 0)
    assert time.monotonic() - started < 30  # fail-fast: far below the call's timeout
    assert "exit code 3" in failure.value.details
    assert len(run_on_ranks(_identity, 2)) == 2


@pytest.mark.timeout(120)
def test_a_hanging_rank_is_named_when_the_deadline_passes():
    run_on_ranks(_identity, 2)
    started = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"ranks \[1\] of 2 did not finish within 2 s") as timeout:
        run_on_ranks(_hang_on, 2, 1, timeout=2)
    assert 2 <= time.monotonic() - started < 30
    assert timeout.value.ranks == [1]
    # The hung rank's own stack comes with the error, down to the line it waits on.
    assert "--- rank 1 (pid" in str(timeout.value) and "in _hang_on" in str(timeout.value)
    assert "--- rank 0" not in str(timeout.value)
    assert run_on_ranks(_hang_on, 2, -1) == ["done"] * 2


@pytest.mark.timeout(120)
def test_each_task_starts_clean():
    ports = run_on_ranks(_leave_dirty_state, 2)
    assert ports[0] == ports[1]
    assert run_on_ranks(_observe_state, 2) == [(None, False, True)] * 2


@pytest.mark.timeout(120)
def test_tasks_see_the_callers_environment(monkeypatch):
    monkeypatch.setenv("ACCEL_TEST_VALUE", "from-parent")
    assert run_on_ranks(_read_env, 2, "ACCEL_TEST_VALUE") == ["from-parent"] * 2
    assert run_on_ranks(_read_env, 2, "LOCAL_WORLD_SIZE") == ["2", "2"]
    assert run_on_ranks(_read_env, 2, "MASTER_ADDR") == ["127.0.0.1"] * 2


def test_an_unpicklable_function_fails_in_the_caller():
    with pytest.raises(Exception, match="pickle|Can't get local"):
        run_on_ranks(lambda: None, 2)


@pytest.mark.timeout(120)
def test_shutdown_stops_every_worker():
    pids = [pid for pid, *_ in run_on_ranks(_identity, 2)]
    spawn_pool.shutdown_pools()
    assert not any(_alive(pid) for pid in pids)
    assert spawn_pool.pool_pids() == set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- The autouse guards of tests/conftest.py, exercised in a separate pytest run -----------------------------------

_LEAKY_TESTS = """
import os, subprocess, sys
import psutil
import torch.distributed as dist
from accel.state import PartialState

SHM_PATH = f"/dev/shm/accel-guard-test-{os.getpid()}"

def test_env_leak():
    os.environ["ACCEL_GUARD_LEAK"] = "1"

def test_env_after():
    assert "ACCEL_GUARD_LEAK" not in os.environ

def test_process_group_leak():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

def test_process_group_after():
    assert not dist.is_initialized()

def test_child_leak():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

def test_child_after():
    assert psutil.Process().children() == []

def test_shm_leak():
    open(SHM_PATH, "w").close()

def test_shm_after():
    assert not os.path.exists(SHM_PATH)

def test_state_set():
    PartialState()

def test_state_after():
    assert PartialState._shared_state == {}
"""


@pytest.mark.timeout(180)
def test_conftest_guards_fail_the_leaking_test_and_protect_the_next(tmp_path):
    tests_dir = Path(__file__).parent
    for name in ("conftest.py", "spawn_pool.py"):
        shutil.copy(tests_dir / name, tmp_path / name)
    (tmp_path / "test_leaks.py").write_text(_LEAKY_TESTS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rE", "-p", "no:cacheprovider", "test_leaks.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )
    errors = {
        line.split(" - ")[0].split("::")[-1]: line for line in run.stdout.splitlines() if line.startswith("ERROR ")
    }
    assert set(errors) == {"test_env_leak", "test_process_group_leak", "test_child_leak", "test_shm_leak"}, (
        run.stdout + run.stderr
    )
    assert "changed environment variables (+added -removed ~changed): +ACCEL_GUARD_LEAK" in run.stdout
    assert "left a torch.distributed process group initialized" in run.stdout
    assert "left child processes alive" in run.stdout and "time.sleep(60)" in run.stdout
    assert "left shared-memory entries behind: /dev/shm/accel-guard-test-" in run.stdout
    # A pure install also reports its one "native kernels unavailable" warning in the summary line.
    assert re.search(r"\b10 passed, (\d+ warnings?, )?4 errors\b", run.stdout), run.stdout
