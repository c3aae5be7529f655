"""The direct path (accel.collectives.direct) against the general path, on real ranks sharing memory.

`gather`, `gather_for_metrics` and `pad_across_processes` of a tensor or a flat tuple, list or dict of CPU tensors
take one direct kernel call; everything else takes the general path. Each rank runs every input both ways and
returns what differed, whether the direct path was taken where it should be (and only there), and the errors.
"""

import collections
import contextlib

import pytest
import torch
from spawn_pool import run_on_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from accel.collectives import (
    DistributedOperationException,
    direct,
    gather,
    operations,
    pad_across,
    pad_across_processes,
)
from accel.data import gather_for_metrics, prepare_data_loader
from accel.pytree import recursively_apply
from accel.state import PartialState
from accel.wire.transport import TorchDistributedTransport
from accel.wire.transport_selection import using_transport

# The direct path calls the native extension's shared-memory kernels: without it every call takes the general path.
pytestmark = pytest.mark.native


def _rows(rank, dtype=torch.float32, extra=()):
    """Rank r's 3 + r rows (ragged across ranks), deterministic."""
    generator = torch.Generator().manual_seed(10 + rank)
    return (torch.randn(3 + rank, *extra, generator=generator) * 100).to(dtype)


def _direct_inputs(rank):
    """Inputs the direct path takes: a tensor, plain tuple, list and dict of tensors (dtypes, non-contiguous)."""
    ints = _rows(rank, torch.int64, (2,))
    return {
        "tensor": _rows(rank),
        "tuple": (_rows(rank, torch.int64), _rows(rank, torch.bfloat16, (4,))),
        "list": [ints.t().contiguous().t(), ints[:, 1], _rows(rank, torch.bool)],
        "dict": {"logits": _rows(rank, torch.float16, (5,)), "labels": _rows(rank, torch.int32)},
        "empty": torch.empty(0, 3),
    }


class _Pair(tuple):
    """A tuple subclass: the general path rebuilds it, so the direct path leaves it alone."""


class _Encoding(dict):
    """A dict subclass (transformers' BatchEncoding is one): the general path keeps its type."""


_Named = collections.namedtuple("_Named", "logits labels")


def _general_inputs(rank):
    """Inputs that must take the general path, each for its own reason."""
    return {
        "nested": (_rows(rank), [_rows(rank)]),
        "0-d leaf": (_rows(rank), torch.tensor(rank)),
        "requires grad": _rows(rank).requires_grad_(),
        "tuple subclass": _Pair((_rows(rank), _rows(rank))),
        "named tuple": _Named(_rows(rank), _rows(rank, torch.int64)),
        "dict subclass": _Encoding(ids=_rows(rank, torch.int64)),
        "parameter": torch.nn.Parameter(_rows(rank), requires_grad=False),
        "empty tuple": (),
    }


def _listed(data):
    """Every leaf's dtype, shape and values, and every dict's keys in order (== on dicts ignores their order)."""
    listed = recursively_apply(lambda tensor: (tensor.dtype, tuple(tensor.shape), tensor.tolist()), data)
    return (listed, list(listed)) if isinstance(listed, dict) else listed


@contextlib.contextmanager
def _direct_calls(entry="shm_all_gather_direct"):
    """The number of calls of ops' direct entry `entry` (the one the direct path uses) inside the block."""
    calls, real = [], getattr(direct.ops, entry)

    def spy(*args):
        calls.append(1)
        return real(*args)

    setattr(direct.ops, entry, spy)
    try:
        yield calls
    finally:
        setattr(direct.ops, entry, real)


def _gather_both_ways():
    rank = PartialState().process_index
    differed, taken, skipped = [], [], []
    for name, data in {**_direct_inputs(rank), **_general_inputs(rank)}.items():
        with _direct_calls() as calls:
            ours = gather(data)
        (taken if calls else skipped).append(name)
        general = operations._gather(data)
        with using_transport(TorchDistributedTransport()):  # torch.distributed's gather needs equal shapes
            reference = operations.gather_ragged(data)
        if not (_listed(ours) == _listed(general) == _listed(reference)) or type(ours) is not type(general):
            differed.append(name)
    return differed, taken, skipped


def test_gather_takes_the_direct_path_for_flat_inputs_and_matches_the_general_path():
    for differed, taken, skipped in run_on_ranks(_gather_both_ways, 2, timeout=90):
        assert not differed
        assert taken == list(_direct_inputs(0))
        assert skipped == list(_general_inputs(0))


def _pad_inputs(rank):
    """Flat inputs whose sizes differ across ranks along dims 0 and 1 (a 1-d leaf has no dim 1: left as it is)."""
    return {
        "tensor": _rows(rank, extra=(1 + rank,)),
        "tuple": (_rows(rank, torch.int64, (2,)), _rows(rank, torch.bfloat16)),
        "list": [_rows(rank, torch.bool, (2 - rank, 3)), torch.empty(0, 1 + rank)],
        "dict": {"logits": _rows(rank, torch.float16, (1 + rank, 2))},
    }


def _pad_both_ways():
    rank = PartialState().process_index
    differed, same_object = [], []
    cases = [(dim, fill, first) for dim in (0, 1, 2, -1) for fill in (0, -1, 2.5, True) for first in (False, True)]
    for name, data in _pad_inputs(rank).items():
        for dim, fill, first in cases:
            with _direct_calls("shm_pad_across_processes_direct") as calls:
                ours = pad_across_processes(data, dim=dim, pad_index=fill, pad_first=first)
            general = pad_across._pad_across_processes(data, dim, fill, first)
            if len(calls) != 1 or _listed(ours) != _listed(general) or type(ours) is not type(general):
                differed.append((name, dim, fill, first))
    tensor = torch.ones(4, 2)  # the same size on every rank: returned as it is, as the general path does
    same_object.append(pad_across_processes(tensor) is tensor)
    return differed, same_object


def test_pad_across_processes_direct_matches_the_general_path():
    for differed, same_object in run_on_ranks(_pad_both_ways, 2, timeout=120):
        assert not differed
        assert same_object == [True]


class _Noting(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _declined():
    """Whether the direct path declines where something must see the call: a forced transport, a dispatch mode, a
    fill value the direct entry does not read; and that the results still match."""
    rank = PartialState().process_index
    # Equal shapes (torch.distributed's gather); the last leaf is one element with a stride.
    data = (torch.full((2, 3), float(rank)), torch.arange(4) + rank, (torch.arange(2) + rank)[::2])
    declined = {}
    with using_transport(TorchDistributedTransport()):
        declined["forced transport"] = direct.all_gather(list(data)) is None
        forced = gather(data)
    with _Noting():
        declined["dispatch mode"] = direct.all_gather(list(data)) is None
        moded = gather(data)
    with torch.device("cpu"):  # a TorchFunctionMode
        declined["function mode"] = direct.all_gather(list(data)) is None
    real = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True  # what torch.compile's tracing sees
    try:
        declined["compiling"] = direct.all_gather(list(data)) is None
    finally:
        torch.compiler.is_compiling = real
    declined["tensor fill"] = direct.pad_across_processes(data, 0, torch.tensor(1.0), False) is None
    same = _listed(forced) == _listed(moded) == _listed(gather(data))
    return declined, same


def test_the_direct_path_declines_when_the_call_must_be_seen():
    for declined, same in run_on_ranks(_declined, 2, timeout=60):
        assert all(declined.values()) and len(declined) == 5, declined
        assert same


def _eval_loop(even_batches):
    """A prepared loader's pass with gather_for_metrics of flat pairs: every sample once, in order; the number of
    direct calls; then the same pass with the direct path off."""
    loader = torch.utils.data.DataLoader(torch.arange(19), batch_size=4)
    prepared = prepare_data_loader(loader, even_batches=even_batches)
    with _direct_calls() as calls:
        seen = [gather_for_metrics((batch * 10, batch))[1] for batch in prepared]
    real_all_gather = direct.all_gather
    direct.all_gather = lambda leaves: None
    try:
        general = [gather_for_metrics((batch * 10, batch))[1] for batch in prepared]
    finally:
        direct.all_gather = real_all_gather
    rank = PartialState().process_index
    return rank, torch.cat(seen).tolist(), torch.cat(general).tolist(), len(calls), len(prepared)


@pytest.mark.parametrize("even_batches", [True, False])
def test_gather_for_metrics_over_a_pass_keeps_every_sample_once(even_batches):
    for rank, seen, general, direct_calls, batches in run_on_ranks(_eval_loop, 2, even_batches, timeout=90):
        # Without even_batches, rank 1 has no batch in the last step: it stands by and gets nothing from it.
        assert seen == general == list(range(19 if even_batches or rank == 0 else 16))
        # 5 batches of 4: with even_batches=False the third step is uneven (rank 1 has no batch), and the general
        # path runs it; the two steps before it take the direct path on both ranks.
        assert direct_calls == (batches if even_batches else 2)


def _mismatch(kind):
    rank = PartialState().process_index
    try:
        if kind == "dtype":
            gather((torch.zeros(2, dtype=torch.int32 if rank else torch.float32),))
        else:
            gather(torch.zeros(2)) if rank == 0 else pad_across_processes(torch.zeros(2))
    except DistributedOperationException as error:  # HF's type for ranks that disagree
        after = gather(torch.full((1,), float(rank)))  # the group is still usable
        return str(error).splitlines()[0], after.tolist()
    return None


@pytest.mark.parametrize("kind", ["dtype", "collective"])
def test_disagreeing_ranks_raise_the_same_error_on_the_direct_path(kind):
    results = run_on_ranks(_mismatch, 2, kind, timeout=60)
    assert results[0] is not None and results[0] == results[1]
    message, after = results[0]
    assert "process 0" in message and "process 1" in message
    assert after == [0.0, 1.0]
