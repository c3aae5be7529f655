"""`all_reduce` on real ranks: accel's shared-memory process group against gloo, interleaved in one run.

Runs inside every rank of a real job, on the process group `PartialState` starts (shared memory on one host):

    accel launch --cpu --num_processes 2 benchmarks/ranked_pytest.py benchmarks/bench_allreduce.py --benchmark-only

(`make bench-process-group` runs it on 2 and 4 ranks of one host; `make bench-hosts` on 2 simulated hosts x 2 ranks,
where `accel` is the group's per-host shared memory with gloo among the hosts' leaders and `gloo` is flat gloo over
the same 4 ranks.) Every rank makes the same calls in the same order; rank 0 reports.

Per payload (float32 bytes per rank), each round times, in an order that alternates between rounds, the same
number of calls of:
- `limit`: one memcpy of the payload into a buffer allocated once, the least an all-reduce has to move;
- `accel`: `torch.distributed.all_reduce(t)` on the default group (the shared-memory backend);
- `gloo`: the same call on a gloo group of the same ranks (what HF Accelerate's groups run on the CPU);
- across hosts only, `leaders`: the same call on a gloo group of the hosts' leaders alone (one rank per host; the
  other ranks skip it), what accel's step between the hosts costs by itself: the least its all-reduce can take.
The ratio gloo/accel is the median over rounds of each round's ratio, so a busy machine's drifts hit both alike.
Issue 16's goals: at least 50x faster than gloo (and at most 35 us) up to 4 KiB, at least 5x at 32 MiB.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch
import torch.distributed as dist
from bench_gather import Interleaved

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = pytest.mark.skipif(WORLD_SIZE < 2, reason="run under `accel launch --num_processes N` (see docstring)")

SIZES = {"64B": 64, "4KiB": 4 << 10, "64KiB": 64 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "32MiB": 32 << 20}
# The payloads measured: ACCEL_BENCH_PAYLOADS (names of SIZES, comma-separated) picks others (`make bench-hosts`).
PAYLOADS = {
    name: SIZES[name] for name in os.environ.get("ACCEL_BENCH_PAYLOADS", "64B,4KiB,256KiB,4MiB,32MiB").split(",")
}
# (rounds, calls per contender and round): the same on every rank, so every rank runs the same collectives.
REPEATS = {
    "64B": (21, 200),
    "4KiB": (21, 200),
    "64KiB": (21, 50),
    "256KiB": (15, 20),
    "4MiB": (11, 3),
    "32MiB": (7, 1),
}


@pytest.fixture(scope="module")
def groups():
    """(the default group, sharing memory: on one host, or inside each host of a job across hosts; a gloo group of the
    same ranks; across hosts, a gloo group of the hosts' leaders, else None)."""
    from accel.state import PartialState
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState()
    assert share_memory_in_default_group() is not None, "the default group does not share memory"
    hosts = _hosts()
    leaders = None if hosts is None else dist.new_group([ranks[0] for ranks in hosts], backend="gloo")
    return dist.group.WORLD, dist.new_group(backend="gloo"), leaders


def _hosts() -> list[list[int]] | None:
    """The ranks of each host when the group spans hosts (accel's HostLeaderBackend), else None."""
    from accel import _C

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.hosts() if isinstance(backend, _C.HostLeaderBackend) else None


def _same_result(tensor: torch.Tensor, gloo) -> None:
    """Both contenders reduce to the same values up to the rounding of their summation orders (checked once)."""
    ours, theirs = tensor.clone(), tensor.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_all_reduce(benchmark, groups, name):
    from accel.collectives import gather_object

    _, gloo, leaders = groups
    tensor = torch.zeros(PAYLOADS[name] // 4)  # summed in place, zeros stay zeros: no overflow, no denormals
    _same_result(torch.randn(PAYLOADS[name] // 4), gloo)
    destination = torch.empty_like(tensor)
    rounds, calls = REPEATS[name]
    contenders = {
        "limit": lambda: destination.copy_(tensor),
        "accel": lambda: dist.all_reduce(tensor),
        "gloo": lambda: dist.all_reduce(tensor, group=gloo),
    }
    if leaders is not None:  # a non-member's call returns at once: it waits for the leaders in the next contender
        contenders["leaders"] = lambda: dist.all_reduce(tensor, group=leaders)
    runs = Interleaved(contenders, calls)
    runs.round()  # warm-up (first touches of the slots and buffers), not recorded
    runs.times = {contender: [] for contender in runs.times}
    benchmark.group = f"all_reduce float32, {WORLD_SIZE} ranks"
    benchmark.pedantic(runs.round, rounds=rounds, iterations=1)
    benchmark.extra_info.update(
        world_size=WORLD_SIZE,
        hosts=_hosts(),
        payload=name,
        calls_per_round=calls,
        **runs.summary("accel", [name for name in contenders if name != "accel"]),
        per_rank_accel_median_s=gather_object([statistics.median(runs.times["accel"])]),
    )
