"""Accelerator.trigger_sync_in_backward and join_uneven_inputs on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from spawn_pool import run_on_ranks

from accel import Accelerator


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _inputs(rank):
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(2, 3, generator=generator), torch.randn(2, 3, generator=generator)


def _local_grads(rank):
    """The gradient of rank `rank`'s two losses, computed without DDP."""
    model = _model()
    for x in _inputs(rank):
        model(x).sum().backward()
    return model.weight.grad.clone()


def _sync_after_no_sync(trigger):
    accelerator = Accelerator()
    model = accelerator.prepare(_model())
    input_a, input_b = _inputs(accelerator.process_index)
    with accelerator.no_sync(model):
        loss_a = model(input_a).sum()
        loss_b = model(input_b).sum()
    accelerator.backward(loss_a)
    if trigger:
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
    else:
        accelerator.backward(loss_b)
    return model.module.weight.grad.clone()


def test_trigger_sync_in_backward_all_reduces_the_accumulated_gradients():
    expected = (_local_grads(0) + _local_grads(1)) / 2
    for grads in run_on_ranks(_sync_after_no_sync, 2, True):
        torch.testing.assert_close(grads, expected)
    local = run_on_ranks(_sync_after_no_sync, 2, False)  # the control: without it, nothing is reduced
    torch.testing.assert_close(local[0], _local_grads(0))
    torch.testing.assert_close(local[1], _local_grads(1))


def test_trigger_sync_in_backward_without_ddp_does_nothing():
    model = _model()
    with Accelerator.trigger_sync_in_backward(model):
        model(torch.ones(1, 3)).sum().backward()
    assert model.weight.grad is not None


def _train_uneven(length, even_batches_override):
    accelerator = Accelerator()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.arange(length * 3, dtype=torch.float32).view(length, 3))
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = 0
    with accelerator.join_uneven_inputs([model], even_batches=even_batches_override) as joined:
        assert joined == [model]
        for (x,) in loader:
            loss = model(x).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    sampler = loader.batch_sampler
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return batches, sampler.even_batches, loader.joined_by_torch, weights


def test_join_uneven_inputs_trains_processes_with_different_batch_counts():
    (batches_0, even_0, joined_0, weights_0), (batches_1, even_1, joined_1, weights_1) = run_on_ranks(
        _train_uneven, 2, 5, False
    )
    assert (batches_0, batches_1) == (3, 2)  # 5 samples: one process has a batch more
    assert even_0 and even_1 and not joined_0 and not joined_1  # the loaders' settings are restored
    torch.testing.assert_close(weights_0, weights_1, atol=0, rtol=0)  # Join kept the replicas identical


def test_join_uneven_inputs_with_even_batches_is_plain_training():
    results = run_on_ranks(_train_uneven, 2, 5, None)  # the Accelerator's even_batches=True: no Join needed
    assert [batches for batches, *_ in results] == [3, 3]
    torch.testing.assert_close(results[0][3], results[1][3], atol=0, rtol=0)


def test_join_uneven_inputs_outside_distribution_yields_the_joinables():
    accelerator = Accelerator()
    model = accelerator.prepare(_model())
    with accelerator.join_uneven_inputs([model], even_batches=False) as joined:
        assert joined == [model]


def test_join_needs_joinable_objects():
    from accel.strategies.ddp_sync import joinable

    with pytest.raises(TypeError, match="join_uneven_inputs needs DDP models"):
        joinable(torch.nn.Linear(1, 1))


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6).float())


def _override_warnings():
    import warnings

    from accel.state import DistributedType

    accelerator = Accelerator()
    model = accelerator.prepare(_model())
    stream = accelerator.prepare(torch.utils.data.DataLoader(_Stream(), batch_size=2))
    with warnings.catch_warnings(record=True) as iterable_warnings:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            stream_even = stream.even_batches
    accelerator.state.distributed_type = DistributedType.FSDP  # what HF's test_distributed_data_loop does
    try:
        with warnings.catch_warnings(record=True) as other_setup_warnings:
            warnings.simplefilter("always")
            with accelerator.join_uneven_inputs([object()]):
                pass
    finally:
        accelerator.state.distributed_type = DistributedType.MULTI_CPU
    return stream_even, [str(w.message) for w in iterable_warnings], [str(w.message) for w in other_setup_warnings]


def test_join_warns_as_hf_for_iterable_loaders_and_setups_without_ddp():
    for stream_even, iterable_messages, other_messages in run_on_ranks(_override_warnings, 2):
        assert stream_even  # a dispatched iterable loader is not overridden, as in HF
        assert any("only supported for map-style datasets" in m for m in iterable_messages)
        assert any("only supported for multi-GPU and multi-CPU (DDP)" in m for m in other_messages)
