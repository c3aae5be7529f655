"""accel.launchers: notebook_launcher and debug_launcher fork real CPU processes joined by gloo.

The launched functions live at module level and report through files in tmp_path, so each test checks what every
rank saw. The conftest guards check that nothing (environment variables, processes, a process group) is left
behind; these tests also check the parent's signal handlers.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.multiprocessing import ProcessRaisedException

from accel.launchers import debug_launcher, notebook_launcher
from accel.state import AcceleratorState, PartialState

pytestmark = pytest.mark.timeout(120)
CHILD_ENV = ("ACCEL_MIXED_PRECISION", "ACCEL_FORK_LAUNCHED", "ACCEL_USE_CPU")

needs_no_gpu = pytest.mark.skipif(
    torch.cuda.device_count() > 0,  # NVML count: leaves this process fork-safe
    reason="the CPU path: on a GPU machine the launched processes would take the GPUs",
)


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch):
    """The test process itself is never "launched", whatever the shell running pytest exports."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", *CHILD_ENV):
        monkeypatch.delenv(name, raising=False)


def _report_rank(out_dir: str) -> None:
    state = PartialState()
    total = torch.tensor([state.process_index + 1])
    dist.all_reduce(total)
    report = {
        "distributed_type": state.distributed_type.value,
        "process_index": state.process_index,
        "num_processes": state.num_processes,
        "total": total.item(),
        "env": {name: os.environ.get(name) for name in CHILD_ENV},
    }
    with open(os.path.join(out_dir, f"rank{state.process_index}.json"), "w") as f:
        json.dump(report, f)


def _fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gave up")


def _reinitialize_cuda() -> None:
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, ...")


def _read_reports(out_dir) -> list[dict]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def _handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


# --- debug_launcher ----------------------------------------------------------------------------------------------


def test_debug_launcher_runs_two_cpu_ranks_with_a_collective(tmp_path):
    env_before = dict(os.environ)
    debug_launcher(_report_rank, args=(str(tmp_path),), num_processes=2)
    reports = _read_reports(tmp_path)
    assert [r["process_index"] for r in reports] == [0, 1]
    assert {r["distributed_type"] for r in reports} == {"MULTI_CPU"}
    assert {r["num_processes"] for r in reports} == {2}
    assert {r["total"] for r in reports} == {3}
    assert reports[0]["env"] == {"ACCEL_MIXED_PRECISION": "no", "ACCEL_FORK_LAUNCHED": "1", "ACCEL_USE_CPU": "1"}
    assert dict(os.environ) == env_before


def test_debug_launcher_raises_the_failing_rank_error():
    with pytest.raises(ProcessRaisedException, match="rank 1 gave up"):
        debug_launcher(_fail_on_rank_1, num_processes=2)


# --- notebook_launcher -------------------------------------------------------------------------------------------


@needs_no_gpu
def test_notebook_launcher_runs_two_cpu_ranks_with_a_collective(tmp_path):
    """Also: a PartialState already made here is not inherited by the forked ranks, and the parent is restored."""
    PartialState()  # single process here; each forked rank must still resolve its own rank
    env_before, handlers_before = dict(os.environ), _handlers()
    rdzv_conf = {}
    notebook_launcher(
        _report_rank, args=(str(tmp_path),), num_processes=2, mixed_precision="bf16", use_port="0", rdzv_conf=rdzv_conf
    )
    reports = _read_reports(tmp_path)
    assert [r["process_index"] for r in reports] == [0, 1]
    assert {r["distributed_type"] for r in reports} == {"MULTI_CPU"}
    assert {r["total"] for r in reports} == {3}
    assert reports[1]["env"] == {"ACCEL_MIXED_PRECISION": "bf16", "ACCEL_FORK_LAUNCHED": "1", "ACCEL_USE_CPU": "1"}
    assert dict(os.environ) == env_before
    assert _handlers() == handlers_before  # torch's elastic agent replaces them; the launcher puts them back
    assert rdzv_conf == {}


@needs_no_gpu
def test_notebook_launcher_raises_the_failing_rank_error():
    with pytest.raises(ChildFailedError, match="rank 1 gave up"):
        notebook_launcher(_fail_on_rank_1, num_processes=2, use_port="0", monitor_interval=0.05)


@needs_no_gpu
def test_notebook_launcher_explains_cuda_initialized_before_the_fork():
    with pytest.raises(RuntimeError, match="CUDA has been initialized in this process") as raised:
        notebook_launcher(_reinitialize_cuda, num_processes=2, use_port="0", monitor_interval=0.05)
    assert isinstance(raised.value.__cause__, ChildFailedError)


def test_notebook_launcher_refuses_when_an_accelerator_state_exists():
    AcceleratorState(cpu=True, _from_accelerator=True)
    with pytest.raises(ValueError, match="should only be initialized inside your training function"):
        notebook_launcher(_fail_on_rank_1, num_processes=2, use_port="0")


def test_notebook_launcher_refuses_when_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA has been initialized"):
        notebook_launcher(_fail_on_rank_1, num_processes=2, use_port="0")


@pytest.mark.parametrize("launch", [debug_launcher, notebook_launcher], ids=["debug", "notebook"])
def test_launchers_refuse_when_a_process_group_exists(launch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="process group is already initialized"):
            launch(_fail_on_rank_1, num_processes=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_processes", [1, pytest.param(None, marks=needs_no_gpu)])
def test_one_process_runs_in_the_caller(num_processes, monkeypatch):
    monkeypatch.setenv("ACCEL_TEST_SETTING", "before")
    seen = {}

    def record():
        seen.update(pid=os.getpid(), mixed_precision=os.environ.get("ACCEL_MIXED_PRECISION"))
        os.environ["ACCEL_TEST_SETTING"] = "set by the function"

    notebook_launcher(record, num_processes=num_processes, mixed_precision="bf16")
    assert seen == {"pid": os.getpid(), "mixed_precision": "bf16"}
    assert "ACCEL_MIXED_PRECISION" not in os.environ
    assert os.environ["ACCEL_TEST_SETTING"] == "set by the function"  # only the launcher's own variables go


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mixed_precision": "fp64"}, "Unknown mixed_precision mode"),
        ({"node_rank": 2, "num_nodes": 2}, "node_rank must be less than the number of nodes"),
        ({"num_processes": 0}, "at least one process"),
        ({"num_nodes": 2, "use_port": "0"}, "picks a port on this machine only"),
    ],
)
def test_notebook_launcher_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        notebook_launcher(_fail_on_rank_1, **{"num_processes": 2, **kwargs})


def _fail_first_attempt(out_dir: str) -> None:
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt == "0":
        raise RuntimeError("first attempt fails")
    _report_rank(out_dir)


@needs_no_gpu
def test_notebook_launcher_restarts_failed_processes_up_to_max_restarts(tmp_path):
    """Through the c10d rendezvous (the other tests use the static one)."""
    notebook_launcher(
        _fail_first_attempt,
        args=(str(tmp_path),),
        num_processes=2,
        use_port="0",
        max_restarts=1,
        rdzv_backend="c10d",
        monitor_interval=0.05,
    )
    assert {r["total"] for r in _read_reports(tmp_path)} == {3}
