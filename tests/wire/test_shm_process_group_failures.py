"""The shared-memory process group when a rank dies or never arrives: every other rank fails fast with an error
naming it, well before the group's timeout, and nothing is left behind (the conftest guard checks /dev/shm)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from separate_ranks import run_separate_ranks
from spawn_pool import run_on_ranks

from accel.state import PartialState

pytestmark = pytest.mark.native

GROUP_TIMEOUT_S = 60


def _start_rank(rank: int, world: int, port: int):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    assert share_memory_in_default_group() is not None


def _all_reduce_until_a_rank_dies(rank: int, world: int, port: int, victim: int, folder: str) -> None:
    _start_rank(rank, world, port)
    if rank == victim:  # dies inside one of the all-reduces below
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    data = torch.ones(4 << 20)  # 16 MiB: many rounds per call, so the death lands mid-call
    started = time.monotonic()
    try:
        while time.monotonic() - started < GROUP_TIMEOUT_S:
            dist.all_reduce(data)
    except Exception as error:  # noqa: BLE001 - what the survivor saw is the result
        failed_after = time.monotonic() - started
        try:
            dist.all_reduce(torch.ones(4))
            again = "no error"
        except Exception as second:  # noqa: BLE001
            again = str(second)
        _report(folder, rank, [type(error).__name__, str(error), failed_after, again])
        os._exit(0)  # the dead peer cannot join a clean shutdown of the group
    _report(folder, rank, ["none", "", time.monotonic() - started, ""])


def _report(folder: str, rank: int, report: list) -> None:
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
        json.dump(report, file)


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_all_reduce_fails_every_other_rank_fast(tmp_path):
    world, victim = 3, 1
    ranks, hung = run_separate_ranks(_all_reduce_until_a_rank_dies, world, victim, str(tmp_path), timeout=100)
    assert hung == []
    assert [rank.exitcode for rank in ranks] == [0, -signal.SIGKILL, 0]
    victim_pid = ranks[victim].pid
    for rank in (0, 2):
        kind, message, failed_after, again = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert kind == "DistBackendError", (rank, kind, message)
        assert f"rank {victim}" in message and str(victim_pid) in message, message
        assert failed_after < 20, f"rank {rank} noticed only after {failed_after:.1f} s"
        assert "cannot be used after an earlier failure" in again, again


def _one_rank_never_arrives(timeout_s: float):
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState(timeout=timedelta(seconds=timeout_s))
    assert share_memory_in_default_group() is not None
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 1)  # alive, but never calls the collective
        return None
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError) as error:
        dist.all_reduce(torch.ones(10))
    return time.monotonic() - started, str(error.value)


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_times_out_at_the_group_timeout():
    elapsed, message = run_on_ranks(_one_rank_never_arrives, 2, 3.0, timeout=40)[0]
    assert 2.9 <= elapsed < 15
    assert "timed out after 3000 ms waiting for rank 1" in message
