"""pad_tensor and pad_across_processes: HF Accelerate's semantics on real ranks, autograd, tracing."""

from collections import namedtuple

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.collectives import DistributedOperationException, pad_across_processes, pad_reference, pad_tensor
from accel.state import PartialState

Pair = namedtuple("Pair", "first second")


def _pad_nested(world_size):
    rank = PartialState().process_index
    data = {
        "ids": torch.full((rank + 1, 2), rank, dtype=torch.int64),
        "mask": [torch.ones(rank + 1, dtype=torch.bool)],
        "pair": Pair(torch.arange(rank + 2.0), torch.zeros(3, 1 + rank)),
        "scalar": torch.tensor(float(rank)),
    }
    padded = pad_across_processes(data, dim=0, pad_index=-1)
    last = pad_across_processes(data["pair"].second, dim=1, pad_index=7, pad_first=True)
    return padded, last


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pads_every_leaf_of_a_nested_structure_to_the_largest_rank(world_size):
    for rank, (padded, last) in enumerate(run_on_ranks(_pad_nested, world_size, world_size)):
        assert padded["ids"].shape == (world_size, 2) and padded["ids"].dtype == torch.int64
        assert padded["ids"][: rank + 1].eq(rank).all() and padded["ids"][rank + 1 :].eq(-1).all()
        assert padded["mask"][0].dtype == torch.bool and padded["mask"][0].tolist() == [True] * world_size
        assert isinstance(padded["pair"], Pair) and padded["pair"].first.shape == (world_size + 1,)
        assert padded["pair"].first[rank + 2 :].eq(-1).all()
        assert padded["scalar"].item() == rank  # no dim 0 to pad: returned as is
        assert last.shape == (3, world_size) and last[:, : world_size - 1 - rank].eq(7).all()  # pad_first


def _native_vs_reference():
    rank = PartialState().process_index
    tensor = torch.randn(5 + 3 * rank, 4, generator=torch.Generator().manual_seed(rank))
    return pad_across_processes(tensor, pad_index=float("nan")), tensor


@pytest.mark.native
def test_native_result_on_ranks_is_the_reference_bit_for_bit():
    for padded, tensor in run_on_ranks(_native_vs_reference, 2):
        expected = pad_reference(tensor, 0, 8, float("nan"))
        assert torch.equal(padded.view(torch.int32), expected.view(torch.int32))


def _mismatched_ranks(dim):
    rank = PartialState().process_index
    try:
        pad_across_processes(torch.zeros([2] * (rank + 1)), dim=dim)
    except DistributedOperationException as error:  # HF's type, in debug mode or not
        return str(error)
    return None


@pytest.mark.parametrize("dim", [0, 1])  # dim 1 exists on rank 1 only: no rank may skip the exchange and hang
def test_tensors_of_different_rank_across_processes_are_an_error(dim):
    messages = run_on_ranks(_mismatched_ranks, 2, dim, timeout=60)
    assert all(m is not None and "ranks hold tensors of different ranks" in m for m in messages)


def test_single_process_returns_the_same_object():
    tensor = torch.ones(3)
    assert pad_across_processes(tensor) is tensor


def test_non_tensor_leaves_are_a_type_error():
    with pytest.raises(TypeError, match="Unsupported types.*str.*pad_across_processes"):
        pad_across_processes({"a": "text"})


def test_gradients_flow_through_padding():
    tensor = torch.randn(2, 3, requires_grad=True)
    padded = pad_tensor(tensor, 1, 5, 0.0, pad_first=True)
    padded.sum().backward()
    assert torch.equal(tensor.grad, torch.ones(2, 3))


def test_zero_dim_is_the_same_error_in_both_modes():
    with pytest.raises(RuntimeError, match="0-d tensor"):
        pad_tensor(torch.tensor(1.0), 0, 2)


@pytest.mark.native
def test_overlapping_src_and_out_are_refused():
    buffer = torch.zeros(6)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.ops.accel.pad_into(buffer[:4], 0, 0, True, buffer)


@pytest.mark.native
def test_the_fake_kernel_traces_and_checks_shapes():
    from accel import ops

    src, out = torch.empty(2, 3, device="meta"), torch.empty(2, 5, device="meta")
    ops.pad_into(src, 1, 0, False, out)  # meta tensors run the registered fake
    with pytest.raises(RuntimeError, match="out.size\\(0\\)"):
        ops.pad_into(src, 1, 0, False, torch.empty(3, 5, device="meta"))

    def pad_by_two(x):
        out = torch.empty(x.shape[0], x.shape[1] + 2, dtype=x.dtype)
        ops.pad_into(x, 1, -1, False, out)
        return out * 2

    x = torch.randn(3, 4)
    compiled = torch.compile(pad_by_two, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), pad_reference(x, 1, 6, -1) * 2)


def _mismatched_counts():
    from accel.state import PartialState

    try:
        pad_across_processes([torch.ones(2)] * (PartialState().process_index + 1))
    except DistributedOperationException as error:
        return str(error)
    return None


def test_different_numbers_of_tensors_are_an_error_on_every_rank():
    messages = run_on_ranks(_mismatched_counts, 2, timeout=60)
    assert messages[0] == messages[1] and "different numbers of tensors" in messages[0]
