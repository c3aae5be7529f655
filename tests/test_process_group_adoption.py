"""A process group someone else initialized, adopted by `PartialState` / `Accelerator` (accel.wire.process_group).

A user's own `init_process_group("gloo")` on 2 ranks of one host, then `Accelerator()`: the default group's CPU
backend becomes accel's shared-memory backend (natively; gloo with ACCEL_TRANSPORT=torch or without the extension),
and collectives, `gather`, `gather_for_metrics` and DDP training give the same results either way. Without LOCAL_RANK
in the environment (a user's group; a group PartialState starts from RANK/WORLD_SIZE alone, as under Kubeflow), the
local rank and local world size come from the ranks' host identities (simulated hosts), a group spanning hosts shares
memory inside each host, and a launcher's LOCAL_RANK is kept. The adoption happens once per group.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from spawn_pool import run_on_ranks

from accel import _ext
from accel.state import PartialState

SHARED = "accel" if _ext.status().loaded else "gloo"  # what a group of one host becomes where memory is shared


def _cpu_backend_name() -> str:
    return dist.group.WORLD._get_backend(torch.device("cpu")).name()


def _without_launcher_placement() -> None:
    """A group the user starts by hand (mp.spawn, a notebook, Kubeflow's one process per pod): no LOCAL_RANK."""
    os.environ.pop("LOCAL_RANK", None)
    os.environ.pop("LOCAL_WORLD_SIZE", None)


def _train(accelerator, steps: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    """A few DDP steps of a small model with BatchNorm (DDP broadcasts its buffers), each rank on its own data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(accelerator.process_index)
    losses = []
    for _ in range(steps):
        inputs, targets = torch.randn(8, 12, generator=generator), torch.randn(8, 3, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def _user_group_then_accelerator() -> dict:
    from accel import Accelerator

    _without_launcher_placement()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    before = _cpu_backend_name()
    accelerator = Accelerator()
    rank = accelerator.process_index
    summed = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(summed)
    gathered = accelerator.gather(accelerator.pad_across_processes(torch.full((rank + 1, 2), rank + 1.0)))
    metrics = accelerator.gather_for_metrics(torch.tensor([rank, rank + 10]))
    losses, parameters = _train(accelerator)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return {
        "before": before,
        "after": backend.name(),
        "dist.get_backend": dist.get_backend(),
        "rounds": backend.rounds() if backend.name() == "accel" else 0,
        "local": (accelerator.local_process_index, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]),
        "timeout": accelerator.state.timeout,
        "all_reduce": summed,
        "gather": gathered,
        "metrics": metrics,
        "losses": losses,
        "parameters": parameters,
    }


@pytest.mark.timeout(180)
def test_a_users_gloo_group_is_adopted_and_shares_memory(monkeypatch):
    shared = run_on_ranks(_user_group_then_accelerator, 2, timeout=120)
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")
    plain = run_on_ranks(_user_group_then_accelerator, 2, timeout=120)
    for rank in range(2):
        assert shared[rank]["before"] == "gloo" and shared[rank]["after"] == SHARED
        assert plain[rank]["before"] == plain[rank]["after"] == "gloo"  # ACCEL_TRANSPORT=torch leaves it untouched
        for run in (shared[rank], plain[rank]):
            assert run["dist.get_backend"] == "gloo"  # what HF Accelerate and torch report, unchanged
            assert run["local"] == (rank, str(rank), "2")  # one host: local rank = rank, derived without LOCAL_RANK
            assert run["timeout"] == timedelta(seconds=60)  # the user's group's own timeout
            assert torch.equal(run["all_reduce"], torch.arange(5, dtype=torch.float32) * 3)
            assert torch.equal(run["gather"], torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]))
            assert torch.equal(run["metrics"], torch.tensor([0, 10, 1, 11]))
        assert shared[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5, abs=1e-6)
        for ours, theirs in zip(shared[rank]["parameters"], plain[rank]["parameters"]):
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    if SHARED == "accel":  # the traffic went through shared memory, not only the label
        assert shared[0]["rounds"] > 0 and shared[1]["rounds"] > 0
    for ours, theirs in zip(shared[0]["parameters"], shared[1]["parameters"]):  # the replicas stay identical
        assert torch.equal(ours, theirs)


def _on_simulated_hosts(hosts: list[str], keep_launcher_values: bool, users_group: bool = True) -> tuple:
    """Each rank claims the host named hosts[rank] (the rest of its identity unchanged), then adopts its group (the
    user's, or the one PartialState starts from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from accel.wire import same_host

    real = same_host.host_identity
    same_host.host_identity = lambda: (hosts[int(os.environ["RANK"])], *real()[1:])
    try:
        if not keep_launcher_values:
            _without_launcher_placement()
        if users_group:
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        state = PartialState()
        return state.local_process_index, int(os.environ["LOCAL_WORLD_SIZE"]), _cpu_backend_name()
    finally:
        same_host.host_identity = real


@pytest.mark.timeout(120)
def test_local_ranks_come_from_the_hosts_when_no_launcher_gave_them():
    # Three ranks on two hosts, interleaved (not rank % n): each host numbers its ranks in rank order. The group that
    # spans the hosts shares memory inside host a (accel's HostLeaderBackend, natively).
    results = run_on_ranks(_on_simulated_hosts, 3, ["a", "b", "a"], False, timeout=90)
    assert results == [(0, 2, SHARED), (0, 1, SHARED), (1, 2, SHARED)]


@pytest.mark.timeout(120)
def test_one_process_per_pod_without_local_rank_is_local_rank_zero():
    # A Kubeflow PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, no LOCAL_RANK; PartialState starts
    # the group.
    assert run_on_ranks(_on_simulated_hosts, 2, ["a", "b"], False, False, timeout=90) == [(0, 1, "gloo")] * 2


@pytest.mark.timeout(120)
def test_a_launchers_local_rank_is_kept():
    # spawn_pool sets LOCAL_RANK=rank and LOCAL_WORLD_SIZE=2 like torchrun; the hosts would say otherwise.
    assert run_on_ranks(_on_simulated_hosts, 2, ["a", "b"], True, timeout=90) == [(0, 2, "gloo"), (1, 2, "gloo")]


def _made_again_on_one_rank() -> tuple[str, int]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    PartialState()
    if dist.get_rank() == 0:  # alone: a second adoption of the same group would wait 60 s for rank 1, then fail
        PartialState._reset_state()
        PartialState()
    dist.barrier()
    return _cpu_backend_name(), PartialState().num_processes


@pytest.mark.timeout(120)
def test_a_group_is_adopted_once():
    assert run_on_ranks(_made_again_on_one_rank, 2, timeout=40) == [(SHARED, 2)] * 2
