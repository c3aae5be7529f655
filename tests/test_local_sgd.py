"""accel.local_sgd.LocalSGD: local steps without gradient synchronization, parameters averaged every K steps."""

from types import SimpleNamespace

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.accelerator import Accelerator
from accel.local_sgd import LocalSGD
from accel.state import DistributedType


def _local_sgd_run(local_sgd_steps, steps):
    """Trains on rank-specific data; records every rank's parameters after each optimizer step."""
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(100 + accelerator.process_index)  # different data per rank
    history = []
    with LocalSGD(accelerator, model, local_sgd_steps=local_sgd_steps) as local_sgd:
        for _ in range(steps):
            x = torch.randn(8, 4, generator=generator)
            loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            history.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    final = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    return accelerator.distributed_type, history, final


def test_parameters_differ_between_syncs_and_agree_after_them():
    (kind, history_0, final_0), (_, history_1, final_1) = run_on_ranks(_local_sgd_run, 2, 3, 4)
    assert kind == DistributedType.MULTI_CPU
    for step in range(4):  # steps 1, 2, 4: local (no gradient all-reduce); step 3: averaged
        if (step + 1) % 3 == 0:
            torch.testing.assert_close(history_0[step], history_1[step], atol=0, rtol=0)
        else:
            assert not torch.allclose(history_0[step], history_1[step])
    torch.testing.assert_close(final_0, final_1, atol=0, rtol=0)  # leaving the block averages once more
    torch.testing.assert_close(final_0, (history_0[3] + history_1[3]) / 2)


def test_one_process_trains_as_usual():
    kind, history, final = _local_sgd_run(2, 3)
    assert kind == DistributedType.NO
    torch.testing.assert_close(final, history[-1], atol=0, rtol=0)


def test_refuses_other_distributed_types_and_bad_step_counts():
    with pytest.raises(NotImplementedError, match="only for CPUs and GPUs"):
        LocalSGD(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED), torch.nn.Linear(1, 1), 2)
    with pytest.raises(ValueError, match="positive integer"):
        LocalSGD(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), torch.nn.Linear(1, 1), 0)
    disabled = LocalSGD(
        SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), torch.nn.Linear(1, 1), None, enabled=False
    )
    with disabled as local_sgd:
        local_sgd.step()
    assert local_sgd.num_steps == 1
