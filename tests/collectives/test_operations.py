"""gather, broadcast, reduce and the object collectives on real gloo ranks, and debug-mode verification.

Each rank builds `_tree(rank)` deterministically, so the parent computes what every collective must return.
One rank function runs many checks per world size, to keep the spawns few.
"""

import functools
import os
from collections import namedtuple

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.collectives import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    reduce,
)
from accel.pytree import tensor_leaves
from accel.state import PartialState

Pair = namedtuple("Pair", "left right")
REDUCE_OPS = ("sum", "mean", "max", "min")


class Encoding(dict):
    """Like transformers' BatchEncoding: a dict subclass with attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _floats(rank):
    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    return {
        "f32": base,
        "f64": [base.double()[:, 1::2]],  # non-contiguous
        "f16": Pair(base.half().t(), torch.tensor(rank + 0.5, dtype=torch.float16)),  # 0-d
        "bf16": (base.bfloat16(), torch.empty(0, 3, dtype=torch.bfloat16)),  # empty
    }


def _tree(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    ints = torch.randint(-50, 50, (3, 2), generator=generator)
    return {
        **_floats(rank),
        "enc": Encoding(ids=ints, mask=torch.rand(5, generator=generator) > 0.5),
        "small_ints": [ints.to(torch.int32), ints.to(torch.int16).t(), ints.to(torch.int8), ints.abs().to(torch.uint8)],
        "scalar": torch.tensor(rank),
    }


def _tensor_collectives(world_size):
    state = PartialState()
    rank, last = state.process_index, world_size - 1
    tree, floats = _tree(rank), _floats(rank)
    gathered = gather(tree)
    received = _tree(rank)
    returned = broadcast(received, from_process=last)
    reduced = {op: reduce(tree if op != "mean" else floats, op) for op in REDUCE_OPS}
    extra = {"scaled": reduce(floats, "sum", scale=0.5), "none": reduce(floats, "none")}
    try:
        gather({"a": torch.ones(1), "b": "text"})
    except TypeError as error:
        extra["type_error"] = str(error)
    return {
        "gathered": gathered,
        "received": received,
        "in_place": returned is received,
        "reduced": reduced,
        "extra": extra,
        "tree_after": tree,
        "single_gather_is_input": gather(tree) is tree,
    }


@functools.lru_cache(maxsize=None)
def _tensor_results(world_size):
    """One run of `_tensor_collectives` per world size, shared by the tests that check parts of it."""
    return run_on_ranks(_tensor_collectives, world_size, world_size, timeout=90)


def _expected_gather(world_size):
    per_rank = [tensor_leaves(_tree(rank), "gather") for rank in range(world_size)]
    as_1d = [[leaf.reshape(-1, *leaf.shape[1:]) for leaf in leaves] for leaves in per_rank]  # 0-d gathers as 1-d
    return [torch.cat(parts) for parts in zip(*as_1d)]


def _expected_reduce(op, world_size):
    trees = [_tree(rank) if op != "mean" else _floats(rank) for rank in range(world_size)]
    per_rank = [tensor_leaves(tree, "reduce") for tree in trees]
    expected = []
    for leaves in zip(*per_rank):
        stacked = torch.stack(leaves)
        if op in ("max", "min"):
            expected.append(stacked.amax(0) if op == "max" else stacked.amin(0))
        elif stacked.dtype == torch.bool:
            expected.append(stacked.any(0))
        elif stacked.is_floating_point():
            total = stacked.double().sum(0)
            expected.append((total / world_size if op == "mean" else total).to(stacked.dtype))
        else:
            expected.append(stacked.sum(0).to(stacked.dtype))  # integer sums wrap like the dtype does
    return expected


def _same_bits(a, b):
    a, b = a.contiguous(), b.contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.is_floating_point():
        tolerance = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(actual.dtype, 1e-6)
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tolerance, atol=tolerance)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tensor_collectives_on_nested_pytrees_of_every_dtype(world_size):
    results = _tensor_results(world_size)
    expected_gather = _expected_gather(world_size)
    source = tensor_leaves(_tree(world_size - 1), "broadcast")
    for rank, result in enumerate(results):
        assert type(result["gathered"]["enc"]) is Encoding and type(result["gathered"]["f16"]) is Pair
        if world_size == 1:
            assert result["single_gather_is_input"]  # HF: a no-op on one process, 0-d tensors stay 0-d
        else:
            assert all(_same_bits(a, e) for a, e in zip(tensor_leaves(result["gathered"], "g"), expected_gather))
            assert "passed to `gather`" in result["extra"]["type_error"]
        assert result["in_place"]
        assert all(_same_bits(a, e) for a, e in zip(tensor_leaves(result["received"], "b"), source))
        assert all(
            _same_bits(a, e) for a, e in zip(tensor_leaves(result["tree_after"], "t"), tensor_leaves(_tree(rank), "t"))
        )  # inputs untouched


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reduce_each_op_matches_a_local_computation_bit_identically_on_every_rank(world_size):
    results = _tensor_results(world_size)
    for op in REDUCE_OPS:
        expected = _expected_reduce(op, world_size)
        first = tensor_leaves(results[0]["reduced"][op], op)
        for actual, wanted in zip(first, expected):
            _assert_close(actual, wanted)
        for result in results[1:]:
            assert all(_same_bits(a, b) for a, b in zip(tensor_leaves(result["reduced"][op], op), first)), op
    total = tensor_leaves(results[0]["reduced"]["sum"], "s")[: len(tensor_leaves(_floats(0), "f"))]
    scaled = tensor_leaves(results[0]["extra"]["scaled"], "s")
    assert all(_same_bits(s, t * 0.5) for s, t in zip(scaled, total))
    assert all(
        _same_bits(a, b)
        for a, b in zip(tensor_leaves(results[-1]["extra"]["none"], "n"), tensor_leaves(_floats(world_size - 1), "n"))
    )


def _object_collectives(world_size):
    rank = PartialState().process_index
    items = [{"rank": rank, "text": "x" * rank, "pair": (rank, None)}, 1.5]
    shared = [rank, f"from {rank}", {"nested": [rank] * 2}, None]
    returned = broadcast_object_list(shared, from_process=world_size - 1)
    return {
        "items": gather_object(items),
        "string": gather_object(f"rank {rank}"),
        "tuple": gather_object((rank, rank + 1)),
        "shared": shared,
        "in_place": returned is shared,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_object_collectives_with_mixed_python_objects(world_size):
    results = run_on_ranks(_object_collectives, world_size, world_size, timeout=60)
    src = world_size - 1
    for result in results:
        assert result["shared"] == [src, f"from {src}", {"nested": [src] * 2}, None] and result["in_place"]
        if world_size == 1:
            assert result["string"] == "rank 0" and result["tuple"] == (0, 1)
            continue
        assert result["items"] == [
            x for r in range(world_size) for x in ({"rank": r, "text": "x" * r, "pair": (r, None)}, 1.5)
        ]
        assert result["string"] == [f"rank {r}" for r in range(world_size)]
        assert result["tuple"] == [x for r in range(world_size) for x in (r, r + 1)]


def _debug_mismatches(world_size):
    os.environ["ACCEL_DEBUG_MODE"] = "1"  # the worker restores its environment after the task
    rank, last = PartialState().process_index, world_size - 1
    odd = rank == last
    cases = {
        "gather": lambda: gather({"x": torch.zeros(2, 3 + odd)}),
        "broadcast": lambda: broadcast([torch.zeros(2), torch.zeros(1 + odd)]),
        "reduce": lambda: reduce(torch.zeros(2, dtype=torch.float64 if odd else torch.float32)),
        "structure": lambda: gather([torch.zeros(2)] * (1 + odd)),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except DistributedOperationException as error:
            messages[name] = str(error)
    messages["after"] = gather(torch.tensor([rank])).tolist()  # the group is still in step
    return messages


@pytest.mark.parametrize("world_size", [2, 4])
def test_debug_mode_mismatch_raises_on_every_rank_naming_each_ranks_shapes(world_size):
    results = run_on_ranks(_debug_mismatches, world_size, world_size, timeout=60)
    for messages in results:
        assert set(messages) == {"gather", "broadcast", "reduce", "structure", "after"}
        assert messages["after"] == list(range(world_size))
        gather_lines = [f"Process {r}: {{'x': [2, {3 + (r == world_size - 1)}]}}" for r in range(world_size)]
        assert "shape mismatches" in messages["gather"] and all(line in messages["gather"] for line in gather_lines)
        assert "operations.gather" in messages["gather"]
        assert f"Process {world_size - 1}: [[2], [2]]" in messages["broadcast"]
        assert "dtype or device mismatches" in messages["reduce"] and "float64" in messages["reduce"]
        assert f"Process {world_size - 1}: [[2], [2]]" in messages["structure"]
        assert "Process 0: [[2]]" in messages["structure"]


def test_reduce_on_one_process_copies_and_checks_its_arguments():
    tensor = torch.tensor([1.0, 2.0])
    result = reduce({"t": tensor}, "sum", scale=2.0)
    assert result["t"].tolist() == [2.0, 4.0] and tensor.tolist() == [1.0, 2.0]
    assert reduce(tensor, "max") is not tensor
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        reduce(tensor, "avg")
    with pytest.raises(TypeError, match="needs floating-point tensors, got torch.int64"):
        reduce(torch.ones(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="passed to `reduce`"):
        reduce([tensor, "text"])


def test_one_process_collectives_return_their_input():
    data = {"a": torch.ones(()), "b": ["text"]}
    assert gather(data) is data and broadcast(data) is data
    objects = [1, "x"]
    assert gather_object(objects) is objects and broadcast_object_list(objects) is objects
