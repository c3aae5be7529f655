"""Tensors whose memory is not simply their values, through every path that moves a tensor's bytes.

- Conjugate views (`z.conj()`) and negative views (`z.conj().imag`): their memory holds the unconjugated, unnegated
  values, and `contiguous()` returns them as they are. A kernel reading raw memory gathered, padded, reduced or
  saved the wrong values without a word; they must move their values.
- One-element tensors with a stride (`torch.zeros(1, 3)[:, 0]`): torch counts them as contiguous and keeps the
  stride, which a byte view refused.

Each rank checks its results against values computed from plain (resolved) tensors. The suite runs these in both
modes: natively (accel's shared-memory group) and with ACCEL_DISABLE_NATIVE=1 (torch.distributed over gloo).
"""

import pytest
import torch
import torch.distributed as dist
from spawn_pool import run_on_ranks

from accel.checkpoint.safetensors_io import load_file, save_file
from accel.collectives import broadcast, gather, pad_across_processes, reduce
from accel.data.dispatcher import pack, unpack
from accel.state import PartialState


def _complex(rank, rows=2):
    return (torch.arange(rows, dtype=torch.float32) + 1 + 10 * rank) * (1 - 2j)


def _views(rank):
    """{name: (the view, a plain tensor with the same values)} for this rank."""
    z = _complex(rank)
    one = (torch.arange(3.0) + rank).reshape(1, 3)[:, 0]  # stride 3, one element
    return {
        "conjugate": (z.conj(), z.conj().resolve_conj()),
        "negative": (z.conj().imag, z.conj().imag.resolve_neg()),
        "one element, strided": (one, one.clone()),
    }


def _gathered_values(world):
    return {name: torch.cat([_views(rank)[name][1] for rank in range(world)]) for name in _views(0)}


def _collectives_on_views():
    state = PartialState()
    rank, world = state.process_index, state.num_processes
    views, expected = _views(rank), _gathered_values(world)
    wrong = []
    for name, (view, _) in views.items():
        if not torch.equal(gather(view), expected[name]):  # one flat tensor: the direct path natively
            wrong.append(f"gather {name}")
        if not torch.equal(gather({"nested": [view]})["nested"][0], expected[name]):  # the general path
            wrong.append(f"gather of a pytree, {name}")
    # Rank r has 2 + r rows: every rank but the last is padded.
    negative = _complex(rank, rows=2 + rank).conj().imag
    padded = pad_across_processes(negative, pad_index=-7.0)
    plain = torch.full((1 + world,), -7.0)
    plain[: 2 + rank] = negative.resolve_neg()
    if not torch.equal(padded, plain):
        wrong.append("pad_across_processes of a negative view")
    # Broadcast into views: the receivers' views must end up holding the sender's values.
    received = {"conjugate": torch.zeros(2, dtype=torch.complex64).conj(), "negative": _complex(rank).conj().imag}
    sent = {"conjugate": _complex(0).conj(), "negative": _complex(0).conj().imag}
    broadcast(sent if rank == 0 else received, from_process=0)
    for name in sent:
        if rank != 0 and not torch.equal(received[name], sent[name]):
            wrong.append(f"broadcast into a {name} view")
    summed = reduce(_complex(rank).conj().imag, "sum")
    if not torch.equal(summed, sum(_complex(r).conj().imag.resolve_neg() for r in range(world))):
        wrong.append("reduce of a negative view")
    return wrong


@pytest.mark.parametrize("world_size", [2])
def test_views_are_gathered_padded_broadcast_and_reduced_by_their_values(world_size):
    for rank, wrong in enumerate(run_on_ranks(_collectives_on_views, world_size, timeout=90)):
        assert not wrong, f"rank {rank}: {wrong}"


def _process_group_gathers_a_view():
    rank = PartialState().process_index
    gathered = torch.empty(4)
    dist.all_gather_into_tensor(gathered, _complex(rank).conj().imag)
    return torch.equal(gathered, torch.cat([_complex(r).conj().imag.resolve_neg() for r in range(2)]))


# Not tested: an in-place collective on a view (dist.all_reduce(z.conj().imag)) leaves it unchanged under torch's
# own gloo too: torch resolves the view into a copy before any backend sees it and does not copy the result back.
@pytest.mark.native  # accel's process group backend
def test_the_process_group_gathers_a_views_values():
    assert run_on_ranks(_process_group_gathers_a_view, 2, timeout=60) == [True, True]


def test_dispatched_batches_carry_the_views_values():
    batch = {name: view for name, (view, _) in _views(1).items()}
    structure, buffer = pack(batch)
    unpacked = unpack(structure, buffer)
    for name, (_, plain) in _views(1).items():
        assert torch.equal(unpacked[name], plain), name


def test_a_saved_view_loads_with_its_values(tmp_path):
    tensors = {name: view for name, (view, _) in _views(1).items()}
    save_file(tensors, tmp_path / "views.safetensors")
    loaded = load_file(tmp_path / "views.safetensors")
    for name, (_, plain) in _views(1).items():
        assert torch.equal(loaded[name], plain), name
        assert not loaded[name].is_conj() and not loaded[name].is_neg()
