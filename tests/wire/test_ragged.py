"""The speculative ragged all-gather of the torch.distributed transport (accel/wire/ragged.py)."""

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.collectives import DistributedOperationException
from accel.state import PartialState
from accel.wire import ragged
from accel.wire.transport import TorchDistributedTransport


def _rank_leaves(rank, rows, seed):
    generator = torch.Generator().manual_seed(seed * 10 + rank)
    return [
        torch.randn(rows + rank, 3, generator=generator).to(torch.float16),
        torch.randint(0, 9, (rows * 2 + rank,), generator=generator) > 4,
        torch.randn(4, 5, generator=generator)[:, 1::2],
        torch.arange(2 * rows + 2 * rank, dtype=torch.int64)[::2],  # 1-d with a stride: reshape keeps the view
    ]


def _growing_gathers():
    """(call, capacity after it, results equal the expected concatenation) for payloads that outgrow the slot."""
    state = PartialState()
    transport = TorchDistributedTransport()
    report = []
    for call, rows in enumerate([1, 2, 900, 900, 30000, 3]):
        leaves = _rank_leaves(state.process_index, rows, call)
        gathered = transport.all_gather_ragged(leaves)
        everyone = [_rank_leaves(rank, rows, call) for rank in range(state.num_processes)]
        expected = [torch.cat([mine[i] for mine in everyone]) for i in range(len(leaves))]
        same = all(torch.equal(ours, theirs) for ours, theirs in zip(gathered, expected))
        report.append((call, transport._ragged["capacity"], same))
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_round_while_the_slot_fits_two_when_a_rank_outgrows_it(world_size):
    results = run_on_ranks(_growing_gathers, world_size, timeout=120)
    assert all(result == results[0] for result in results)  # the capacity is agreed, not guessed per rank
    for call, capacity, same in results[0]:
        assert same, f"call {call}"
    capacities = [capacity for _, capacity, _ in results[0]]
    assert capacities[0] == capacities[1] == ragged.FIRST_CAPACITY  # small payloads fit the first slot
    assert capacities[2] > ragged.FIRST_CAPACITY and capacities[3] == capacities[2]  # grew once, then stable
    assert capacities[4] > capacities[3] and capacities[5] == ragged.FIRST_CAPACITY  # follows the last call


def _mismatched(kind):
    """The error one ragged gather raises when rank 1's leaves differ from rank 0's in `kind`."""
    rank = PartialState().process_index
    if kind == "dtype":
        leaves = [torch.zeros(2, dtype=torch.float32 if rank else torch.int32)]
    else:
        leaves = [torch.zeros(2)] * (rank + 1)
    try:
        TorchDistributedTransport().all_gather_ragged(leaves)
    except DistributedOperationException as error:  # HF's type for ranks that disagree
        return str(error)
    return None


def test_disagreeing_leaves_raise_on_every_rank():
    messages = run_on_ranks(_mismatched, 2, "dtype")
    assert messages[0] == messages[1] and "process 0: torch.int32" in messages[0]


def test_capacity_is_a_power_of_two_with_room():
    assert ragged.next_capacity(1) == ragged.FIRST_CAPACITY
    assert ragged.next_capacity(5000) == 8192 and ragged.next_capacity(8192) == 8192


def test_different_numbers_of_tensors_raise_on_every_rank():
    messages = run_on_ranks(_mismatched, 2, "count")
    assert messages[0] == messages[1] and "different numbers of tensors" in messages[0]
