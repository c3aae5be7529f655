"""`all_reduce` on real ranks: accel's shared-memory process group against gloo, interleaved in one run.

Runs inside every rank of a real job, on the process group `PartialState` starts (shared memory on one host):

    accel launch --cpu --num_processes 2 benchmarks/ranked_pytest.py benchmarks/bench_allreduce.py --benchmark-only

(`make bench-allreduce` runs it on 2 and 4 ranks and writes docs/benchmarks/allreduce.md and allreduce.png.) Every
rank makes the same calls in the same order; rank 0 reports.

Per payload (float32 bytes per rank), each round times, in an order that alternates between rounds, the same
number of calls of:
- `limit`: one memcpy of the payload into a buffer allocated once, the least an all-reduce has to move;
- `accel`: `torch.distributed.all_reduce(t)` on the default group (the shared-memory backend);
- `gloo`: the same call on a gloo group of the same ranks (what HF Accelerate's groups run on the CPU).
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

PAYLOADS = {"64B": 64, "4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "32MiB": 32 << 20}
# (rounds, calls per contender and round): the same on every rank, so every rank runs the same collectives.
REPEATS = {"64B": (21, 200), "4KiB": (21, 200), "256KiB": (15, 20), "4MiB": (11, 3), "32MiB": (7, 1)}


@pytest.fixture(scope="module")
def groups():
    """(the default group, sharing memory; a gloo group of the same ranks)."""
    from accel.state import PartialState
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState()
    assert share_memory_in_default_group() is not None, "the default group does not share memory"
    return dist.group.WORLD, dist.new_group(backend="gloo")


def _same_result(tensor: torch.Tensor, gloo) -> None:
    """Both contenders reduce to the same values up to the rounding of their summation orders (checked once)."""
    ours, theirs = tensor.clone(), tensor.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_all_reduce(benchmark, groups, name):
    from accel.collectives import gather_object

    _, gloo = groups
    tensor = torch.zeros(PAYLOADS[name] // 4)  # summed in place, zeros stay zeros: no overflow, no denormals
    _same_result(torch.randn(PAYLOADS[name] // 4), gloo)
    destination = torch.empty_like(tensor)
    rounds, calls = REPEATS[name]
    runs = Interleaved(
        {
            "limit": lambda: destination.copy_(tensor),
            "accel": lambda: dist.all_reduce(tensor),
            "gloo": lambda: dist.all_reduce(tensor, group=gloo),
        },
        calls,
    )
    runs.round()  # warm-up (first touches of the slots and buffers), not recorded
    runs.times = {contender: [] for contender in runs.times}
    benchmark.group = f"all_reduce float32, {WORLD_SIZE} ranks"
    benchmark.pedantic(runs.round, rounds=rounds, iterations=1)
    benchmark.extra_info.update(
        world_size=WORLD_SIZE,
        payload=name,
        calls_per_round=calls,
        **runs.summary("accel", ["gloo", "limit"]),
        per_rank_accel_median_s=gather_object([statistics.median(runs.times["accel"])]),
    )
