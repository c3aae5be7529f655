"""accel's shared-memory torch.distributed backend (accel.wire.shm_process_group) on real ranks.

Every op x dtype against a reference reduced in rank order (bit for bit) and against gloo (to rounding), results
bit-identical on every rank; odd sizes, empty and non-contiguous tensors; Parameters (channels_last, views of them)
and expanded tensors in every collective, bit for bit as on gloo; several rounds per call and both all-reduce paths
(small slots); subgroups used concurrently; 4 ranks on 2 cores; mismatched calls; DDP with each comm hook and FSDP2
against the same runs on gloo; ACCEL_TRANSPORT=torch. A killed rank: tests/wire/
test_shm_process_group_failures.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from spawn_pool import run_on_ranks

from accel import _ext
from accel.state import PartialState

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
ARITHMETIC = ("sum", "product", "min", "max")
# (op, dtypes): every combination the backend reduces itself.
COMBINATIONS = [(op, dtype) for op in ARITHMETIC for dtype in (*FLOATS, *INTS, torch.bool)]
COMBINATIONS += [(op, dtype) for op in ("avg", "premul_sum") for dtype in FLOATS]
COMBINATIONS += [(op, dtype) for op in ("band", "bor", "bxor") for dtype in (*INTS, torch.bool)]
PREMUL = 0.375
# Small slots and a small one-shot limit: many rounds per call, and the reduce-scatter + all-gather path.
SMALL_SLOTS = {"ACCEL_SHM_SLOT_BYTES": "8192", "ACCEL_SHM_ONE_SHOT_BYTES": "1000"}


def _shared_backend():
    """This rank's default group, sharing memory (PartialState starts it; sharing is idempotent)."""
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState()
    backend = share_memory_in_default_group()
    assert backend is not None and dist.get_backend() == "gloo"
    assert dist.group.WORLD._get_backend(torch.device("cpu")).name() == "accel"
    return backend


def _torch_op(op: str):
    if op == "premul_sum":
        return dist._make_nccl_premul_sum(PREMUL)
    return {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR,
    }[op]


def _sample(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=generator, dtype=torch.float64) * 3).to(dtype)
    low = 0 if dtype == torch.uint8 else -9
    return torch.randint(low, 10, (numel,), generator=generator).to(dtype)


def reference(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """parts[0] op parts[1] op ... left to right, fp16/bf16 in fp32: what the backend must produce, bit for bit."""
    dtype = parts[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    if dtype == torch.bool:
        logical = {
            "sum": torch.logical_or,
            "max": torch.logical_or,
            "bor": torch.logical_or,
            "product": torch.logical_and,
            "min": torch.logical_and,
            "band": torch.logical_and,
            "bxor": torch.logical_xor,
        }[op]
        result = parts[0]
        for part in parts[1:]:
            result = logical(result, part)
        return result
    combine = {
        "sum": torch.add,
        "avg": torch.add,
        "premul_sum": torch.add,
        "product": torch.mul,
        "min": torch.minimum,
        "max": torch.maximum,
        "band": torch.bitwise_and,
        "bor": torch.bitwise_or,
        "bxor": torch.bitwise_xor,
    }[op]
    result = parts[0].to(wide)
    for part in parts[1:]:
        result = combine(result, part.to(wide))
    if op == "avg":
        result = result / len(parts)
    if op == "premul_sum":  # the sum scaled (NCCL scales each part: the same value up to rounding)
        result = result * PREMUL
    return result.to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _gathered(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `tensor` through `group` (gloo), as raw bytes: gloo gathers no bf16, int16 or bool."""
    out = [torch.empty_like(_bits(tensor)) for _ in range(dist.get_world_size())]
    dist.all_gather(out, _bits(tensor), group=group)
    return [part.view(tensor.dtype) for part in out]


def _gloo_agrees(ours: torch.Tensor, x: torch.Tensor, op: str, group) -> bool:
    """gloo's result to rounding, where gloo has the reduction (it has no avg or premul_sum, nor some dtypes)."""
    theirs = x.clone()
    try:
        dist.all_reduce(theirs, op=_torch_op(op), group=group)
    except (RuntimeError, ValueError):
        return True
    if ours.dtype.is_floating_point:
        return torch.allclose(ours.double(), theirs.double(), rtol=1e-2, atol=1e-2)
    return torch.equal(ours, theirs)


def _all_reduce_matrix(combinations, sizes) -> list[str]:
    backend = _shared_backend()
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    rounds = backend.rounds()
    failures = []
    for op, dtype in combinations:
        for numel in sizes:
            x = _sample(dtype, numel, seed=numel * 7 + rank)
            ours = x.clone()
            dist.all_reduce(ours, op=_torch_op(op))
            what = f"{op} {dtype} [{numel}]"
            if not torch.equal(_bits(ours), _bits(reference(_gathered(x, gloo), op))):
                failures.append(f"{what}: differs from the rank-order reference")
            if not all(torch.equal(_bits(ours), _bits(other)) for other in _gathered(ours, gloo)):
                failures.append(f"{what}: differs between ranks")
            if not _gloo_agrees(ours, x, op, gloo):
                failures.append(f"{what}: differs from gloo")
    assert backend.rounds() > rounds  # the reductions went through shared memory
    return failures


@pytest.mark.native
@pytest.mark.parametrize("settings", [{}, SMALL_SLOTS], ids=["default", "small-slots"])
def test_every_op_and_dtype_reduces_in_rank_order_on_every_rank(monkeypatch, settings):
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    for failures in run_on_ranks(_all_reduce_matrix, 2, COMBINATIONS, [0, 1, 13, 4097, 70001], timeout=120):
        assert failures == [], "\n".join(failures)


@pytest.mark.native
def test_three_ranks_split_uneven_slices(monkeypatch):
    for name, value in SMALL_SLOTS.items():
        monkeypatch.setenv(name, value)
    combinations = [("sum", torch.float32), ("avg", torch.bfloat16), ("max", torch.int64), ("bxor", torch.bool)]
    for failures in run_on_ranks(_all_reduce_matrix, 3, combinations, [1, 2, 5, 3001, 20011], timeout=120):
        assert failures == [], "\n".join(failures)


def _nan_propagation():
    _shared_backend()
    x = torch.tensor([1.0, float("nan"), 3.0]) if dist.get_rank() == 0 else torch.tensor([float("nan"), 2.0, 4.0])
    results = {}
    for op in ("min", "max", "sum"):
        results[op] = x.clone()
        dist.all_reduce(results[op], op=_torch_op(op))
    return results


@pytest.mark.native
def test_min_and_max_propagate_nan():
    nan = float("nan")
    expected = {"min": [nan, nan, 3.0], "max": [nan, nan, 4.0], "sum": [nan, nan, 7.0]}
    for result in run_on_ranks(_nan_propagation, 2):
        for op, values in expected.items():
            torch.testing.assert_close(result[op], torch.tensor(values), rtol=0, atol=0, equal_nan=True)


# --- the other collectives ----------------------------------------------------------------------------------------


def _other_collectives() -> dict:
    backend = _shared_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    rounds = backend.rounds()
    out = {}
    for numel in (0, 1, 1001, 5000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            x = _sample(dtype, numel, rank) if dtype != torch.complex64 else torch.randn(numel, dtype=dtype)
            key = f"{dtype}[{numel}]"
            received = x.clone()
            dist.broadcast(received, src=world - 1)
            out[f"broadcast {key}"] = _bits(received)
            listed = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(listed, x)
            out[f"all_gather {key}"] = torch.cat([_bits(t) for t in listed])
            flat = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(flat, x)
            out[f"all_gather_into_tensor {key}"] = _bits(flat)
            out[f"input {key}"] = _bits(x)
    for numel in (0, 3, 4096 + 5):
        x = _sample(torch.float32, world * numel, rank)
        scattered = torch.empty(numel)
        dist.reduce_scatter_tensor(scattered, x)
        out[f"reduce_scatter {numel}"] = _bits(scattered)
        out[f"reduce_scatter input {numel}"] = _bits(x)
    dist.barrier()
    out["rounds"] = backend.rounds() - rounds
    return out


@pytest.mark.native
def test_broadcast_all_gather_reduce_scatter_match_their_definitions(monkeypatch):
    for name, value in SMALL_SLOTS.items():
        monkeypatch.setenv(name, value)
    world = 2
    results = run_on_ranks(_other_collectives, world, timeout=120)
    for rank, result in enumerate(results):
        assert result["rounds"] > 0
        for key in [k for k in result if k.startswith("input ")]:
            item = key[len("input ") :]
            inputs = [r[key] for r in results]
            assert torch.equal(result[f"broadcast {item}"], inputs[world - 1]), item
            assert torch.equal(result[f"all_gather {item}"], torch.cat(inputs)), item
            assert torch.equal(result[f"all_gather_into_tensor {item}"], torch.cat(inputs)), item
        for numel in (0, 3, 4096 + 5):
            parts = [r[f"reduce_scatter input {numel}"].view(torch.float32) for r in results]
            expected = reference(parts, "sum")[rank * numel : (rank + 1) * numel]
            assert torch.equal(result[f"reduce_scatter {numel}"], _bits(expected)), numel


def _non_contiguous() -> dict:
    _shared_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.arange(24, dtype=torch.float32).view(4, 6) + 100 * rank
    transposed = base.t()  # a strided view: reduced in place through a contiguous copy
    dist.all_reduce(transposed)
    strided = torch.zeros(4, 6)[:, ::2]
    if rank == 0:
        strided.copy_(torch.arange(12.0).view(4, 3))
    dist.broadcast(strided, src=0)
    outputs = [torch.zeros(3, 4).t() for _ in range(world)]
    dist.all_gather(outputs, (torch.arange(12.0).view(3, 4) + rank).t())
    flat = torch.zeros(world * 8, 2)[:, 0]  # the output of all_gather_into_tensor, strided
    dist.all_gather_into_tensor(flat, torch.full((8,), float(rank)))
    in_place = torch.zeros(world * 5)  # the input is this rank's chunk of the output (FSDP2 gathers this way)
    in_place[rank * 5 : (rank + 1) * 5] = rank + 1
    dist.all_gather_into_tensor(in_place, in_place[rank * 5 : (rank + 1) * 5])
    scattered = torch.zeros(4, 2)[:, 1]
    dist.reduce_scatter_tensor(scattered, (torch.arange(4.0 * world) + rank).view(world, 4).t().contiguous().t())
    return {
        "transposed": transposed,
        "base": base,
        "strided": strided,
        "outputs": outputs,
        "flat": flat,
        "in_place": in_place,
        "scattered": scattered,
    }


@pytest.mark.native
def test_non_contiguous_tensors_are_reduced_and_written_in_place():
    world = 2
    results = run_on_ranks(_non_contiguous, world)
    base_sum = sum(torch.arange(24.0).view(4, 6) + 100 * rank for rank in range(world))
    for rank, r in enumerate(results):
        assert torch.equal(r["transposed"], base_sum.t()) and torch.equal(r["base"], base_sum)
        assert torch.equal(r["strided"], torch.arange(12.0).view(4, 3))
        assert all(torch.equal(out, (torch.arange(12.0).view(3, 4) + k).t()) for k, out in enumerate(r["outputs"]))
        assert r["flat"].tolist() == [float(k) for k in range(world) for _ in range(8)]
        assert r["in_place"].tolist() == [float(k + 1) for k in range(world) for _ in range(5)]
        inputs = [(torch.arange(4.0 * world) + k) for k in range(world)]
        assert torch.equal(r["scattered"], sum(inputs)[rank * 4 : (rank + 1) * 4])


# --- Parameters, views of them and expanded tensors: what gloo accepts works, with gloo's bits ---------------------


def _weight(rank: int) -> torch.nn.Parameter:
    """A conv weight as `Conv2d(3, 4, 3).to(memory_format=torch.channels_last)` has it: dense, not contiguous."""
    values = _sample(torch.float32, 4 * 3 * 3 * 3, seed=rank).view(4, 3, 3, 3)
    return torch.nn.Parameter(values.contiguous(memory_format=torch.channels_last))


def _parameter(rank: int) -> torch.nn.Parameter:
    """A Parameter; its column `[:, 0]` is a non-contiguous view that requires grad."""
    return torch.nn.Parameter(_sample(torch.float32, 30, seed=10 + rank).view(5, 6))


def _expanded(rank: int, rows: int = 3) -> torch.Tensor:
    """A tensor whose columns share memory (stride 0)."""
    return (torch.arange(float(rows)) + 10 * rank).view(rows, 1).expand(rows, 4)


def _channels_last(*shape: int) -> torch.Tensor:
    return torch.empty(shape).to(memory_format=torch.channels_last)


def _as(tensor: torch.Tensor, plain: bool) -> torch.Tensor:
    """`tensor`, or with `plain` a contiguous copy that needs no grad: the reference's input (or output)."""
    return tensor.detach().contiguous() if plain else tensor


def _in_place_on_weight(op: str):
    def case(rank, world, group, plain):
        weight = _as(_weight(rank), plain)
        _all_reduce_or_broadcast(op, weight, world, group)
        return [weight]

    return case


def _in_place_on_column(op: str):
    def case(rank, world, group, plain):
        param = _parameter(rank)
        column = _as(param[:, 0], plain)
        _all_reduce_or_broadcast(op, column, world, group)
        return [column, param[:, 1:]]  # the rest of the Parameter is untouched

    return case


def _all_reduce_or_broadcast(op: str, tensor: torch.Tensor, world: int, group) -> None:
    if op == "all_reduce":
        dist.all_reduce(tensor, group=group)
    else:
        dist.broadcast(tensor, src=world - 1, group=group)


def _broadcast_from_expanded(rank, world, group, plain):
    tensor = _as(_expanded(rank) if rank == world - 1 else torch.zeros(3, 4), plain)  # expanded where only read
    dist.broadcast(tensor, src=world - 1, group=group)
    return [tensor]


# The inputs the gathers take, and non-contiguous outputs of the shapes they fill.
GATHERED = {
    "a channels_last weight": (_weight, (4, 3, 3, 3), _channels_last),
    "a column of a Parameter": (lambda rank: _parameter(rank)[:, 0], (5,), lambda n: torch.empty(n, 2)[:, 1]),
    "an expanded tensor": (_expanded, (3, 4), lambda rows, cols: torch.empty(cols, rows).t()),
}


def _all_gather(name: str):
    make, shape, strided = GATHERED[name]

    def case(rank, world, group, plain):
        outputs = [_as(strided(*shape), plain) for _ in range(world)]
        dist.all_gather(outputs, _as(make(rank), plain), group=group)
        return outputs

    return case


def _all_gather_into_tensor(name: str):
    make, shape, strided = GATHERED[name]

    def case(rank, world, group, plain):
        output = _as(strided(shape[0] * world, *shape[1:]), plain)
        dist.all_gather_into_tensor(output, _as(make(rank), plain), group=group)
        return [output]

    return case


def _all_gather_into_columns(rank, world, group, plain):
    param = torch.nn.Parameter(torch.zeros(5, world))
    outputs = [_as(param[:, k], plain) for k in range(world)]
    dist.all_gather(outputs, _as(_parameter(rank)[:, 0], plain), group=group)
    return outputs


def _reduce_scatter_weight(rank, world, group, plain):
    output = _as(_channels_last(4 // world, 3, 3, 3), plain)
    dist.reduce_scatter_tensor(output, _as(_weight(rank), plain), group=group)
    return [output]


def _reduce_scatter_into_columns(rank, world, group, plain):
    param = _parameter(rank)
    columns = _as(param[:, :4], plain)
    dist.reduce_scatter_tensor(columns, _as(_expanded(rank, 5 * world), plain), group=group)
    return [columns, param[:, 4:]]


def _coalesced(*cases):
    """The cases in one coalesced block (`_coalescing_manager`: the backend's coalesced forms)."""

    def case(rank, world, group, plain):
        with dist._coalescing_manager(group=group):
            return [tensor for one in cases for tensor in one(rank, world, group, plain)]

    return case


# name -> case(rank, world, group, plain): the tensors it wrote (plain: the same values in plain tensors).
PARAMETER_CASES = {
    "all_reduce channels_last weight": _in_place_on_weight("all_reduce"),
    "broadcast channels_last weight": _in_place_on_weight("broadcast"),
    "all_reduce column of a Parameter": _in_place_on_column("all_reduce"),
    "broadcast column of a Parameter": _in_place_on_column("broadcast"),
    "broadcast from an expanded tensor": _broadcast_from_expanded,
    **{f"all_gather of {name}": _all_gather(name) for name in GATHERED},
    **{f"all_gather_into_tensor of {name}": _all_gather_into_tensor(name) for name in GATHERED},
    "all_gather into columns of a Parameter": _all_gather_into_columns,
    "reduce_scatter_tensor of a channels_last weight": _reduce_scatter_weight,
    "reduce_scatter_tensor of an expanded tensor into columns of a Parameter": _reduce_scatter_into_columns,
    "all_reduce coalesced": _coalesced(_in_place_on_weight("all_reduce"), _in_place_on_column("all_reduce")),
    "all_gather_into_tensor coalesced": _coalesced(*[_all_gather_into_tensor(name) for name in GATHERED]),
    "reduce_scatter_tensor coalesced": _coalesced(_reduce_scatter_weight, _reduce_scatter_into_columns),
}
# The cases gloo runs right on these very tensors. It all-reduces and broadcasts a tensor's memory as it lies, numel
# elements from the first: right for a dense layout (channels_last), wrong for a column (it takes other elements) or
# an expanded tensor (it runs past the storage). Where it copies into an output, autograd refuses a Parameter or a
# view of one (and the chunks of all_gather_into_tensor's output when the input is a channels_last Parameter).
GLOO_RUNS_AS_IS = [
    "all_reduce channels_last weight",
    "broadcast channels_last weight",
    *[f"all_gather of {name}" for name in GATHERED],
    "all_gather_into_tensor of a column of a Parameter",
    "all_gather_into_tensor of an expanded tensor",
    "reduce_scatter_tensor of a channels_last weight",
    "all_gather_into_tensor coalesced",
]


def _parameters_and_expanded_tensors() -> dict:
    backend = _shared_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    rounds = backend.rounds()
    ours = {name: case(rank, world, None, False) for name, case in PARAMETER_CASES.items()}
    shared_rounds = backend.rounds() - rounds
    reference = {name: case(rank, world, gloo, True) for name, case in PARAMETER_CASES.items()}
    as_is = {name: PARAMETER_CASES[name](rank, world, gloo, False) for name in GLOO_RUNS_AS_IS}
    weight = _weight(rank)
    dist.all_reduce(weight)
    ours_weight = [weight.is_leaf, weight.requires_grad, weight.grad_fn is None, weight._version]
    weight = _weight(rank)
    dist.all_reduce(weight, group=gloo)
    gloo_weight = [weight.is_leaf, weight.requires_grad, weight.grad_fn is None, weight._version]
    expanded = _expanded(rank)
    with pytest.raises(RuntimeError) as refused:  # no result per element to write into: refused after the exchange
        dist.all_reduce(expanded)
    after = torch.full((3,), float(rank + 1))
    dist.all_reduce(after)  # the group is still usable
    return {
        "ours": _all_bits(ours),
        "reference": _all_bits(reference),
        "gloo": _all_bits(as_is),
        "shared_rounds": shared_rounds,
        "weight": (ours_weight, gloo_weight),
        "expanded": (str(refused.value), torch.equal(expanded, _expanded(rank)), after.tolist()),
    }


def _all_bits(results: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {name: [_bits(tensor.detach()) for tensor in tensors] for name, tensors in results.items()}


@pytest.mark.native
def test_parameters_views_and_expanded_tensors_take_part_as_on_gloo_bit_for_bit():
    for rank, result in enumerate(run_on_ranks(_parameters_and_expanded_tensors, 2, timeout=120)):
        assert result["shared_rounds"] >= len(PARAMETER_CASES)  # through shared memory, not handed to gloo
        for name, ours in result["ours"].items():
            assert all(map(torch.equal, ours, result["reference"][name])), f"rank {rank}: {name}"
        for name, theirs in result["gloo"].items():
            assert all(map(torch.equal, result["ours"][name], theirs)), f"rank {rank}: {name} differs from gloo"
        ours_weight, gloo_weight = result["weight"]
        assert ours_weight == gloo_weight == [True, True, True, 0]  # still a leaf, its version untouched as by gloo
        message, unchanged, after = result["expanded"]
        assert "all_reduce cannot write its result into a tensor whose elements share memory" in message, message
        assert unchanged and after == [3.0, 3.0, 3.0]


def _mismatch():
    _shared_backend()
    rank = dist.get_rank()
    messages = []
    for first, second in [(torch.ones(10), torch.ones(11)), (torch.ones(4), torch.ones(4, dtype=torch.float64))]:
        try:
            dist.all_reduce(first if rank == 0 else second)
        except RuntimeError as error:
            messages.append(str(error))
    after = torch.full((3,), float(rank + 1))
    dist.all_reduce(after)  # the group is still usable
    return messages, after.tolist()


@pytest.mark.native
def test_ranks_calling_different_collectives_all_raise_and_the_group_stays_usable():
    for messages, after in run_on_ranks(_mismatch, 2):
        assert len(messages) == 2 and after == [3.0, 3.0, 3.0]
        assert "accel collective mismatch" in messages[0] and "float32[10]" in messages[0]
        assert "float32[11]" in messages[0] and "float64[4]" in messages[1]


def _sequence_of_mixed_collectives(iterations: int) -> float:
    _shared_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.monotonic()
    x = torch.ones(16)
    for step in range(iterations):
        y = x.clone()
        dist.all_reduce(y)
        assert y[0].item() == world
        if step % 10 == 0:
            z = torch.full((7,), float(rank))
            dist.broadcast(z, src=step % world)
            assert z[0].item() == step % world
            dist.barrier()
    return time.monotonic() - started


@pytest.mark.native
@pytest.mark.timeout(120)
def test_four_ranks_on_two_cores_do_not_starve():
    # More ranks than cores: waits sleep early instead of spinning, so every rank gets the core it needs.
    elapsed = run_on_ranks(_sequence_of_mixed_collectives, 4, 300, timeout=100)
    assert max(elapsed) < 30


def _concurrent_subgroups() -> dict:
    _shared_backend()
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1], backend="accel"), dist.new_group([2, 3], backend="accel")]
    odd_even = [dist.new_group([0, 2], backend="accel"), dist.new_group([1, 3], backend="accel")]
    mine, other = pairs[rank // 2], odd_even[rank % 2]
    results = {"names": [dist.get_backend(mine), mine._get_backend(torch.device("cpu")).name()]}
    x = torch.full((1000,), float(rank))
    for _ in range(20):  # both pairs at once, then the other split, then the default group
        a = x.clone()
        dist.all_reduce(a, group=mine)
        b = x.clone()
        dist.all_reduce(b, group=other)
        c = x.clone()
        dist.all_reduce(c)
    results.update(pair=a[0].item(), split=b[0].item(), world=c[0].item())
    return results


@pytest.mark.native
@pytest.mark.timeout(120)
def test_subgroups_share_memory_and_run_concurrently():
    results = run_on_ranks(_concurrent_subgroups, 4, timeout=100)
    for rank, result in enumerate(results):
        assert result["names"] == ["accel", "accel"]
        assert result["pair"] == (0 + 1 if rank < 2 else 2 + 3)
        assert result["split"] == (0 + 2 if rank % 2 == 0 else 1 + 3)
        assert result["world"] == 6


def _backend_name() -> str:
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState()
    share_memory_in_default_group()
    x = torch.ones(3)
    dist.all_reduce(x)
    return dist.group.WORLD._get_backend(torch.device("cpu")).name()


def test_accel_transport_torch_keeps_gloo(monkeypatch):
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")
    assert run_on_ranks(_backend_name, 2) == ["gloo", "gloo"]


def test_the_group_shares_memory_exactly_when_the_extension_is_there():
    assert run_on_ranks(_backend_name, 2) == ["accel" if _ext.status().loaded else "gloo"] * 2


# --- training ------------------------------------------------------------------------------------------------------

# DDP refuses its bf16 hook without CUDA and NCCL (torch 2.13's _check_comm_hook), on gloo as here.
HOOKS = ("no", "fp16", "power_sgd", "batched_power_sgd")


def _ddp_training(hook: str, share: bool, steps: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    """Trains a small model with BatchNorm (broadcast_buffers) under DDP through the Accelerator."""
    from accel import Accelerator
    from accel.accelerator_config import DistributedDataParallelKwargs
    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState()
    assert (share_memory_in_default_group() is not None) == share
    # PowerSGD compresses from its second step on (its default waits 1000 steps). torch 2.13's batched variant fails
    # in its compression step on gloo too (_orthogonalize gets a 2-d matrix), so it runs its all-reduce steps only.
    state = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2} if hook == "power_sgd" else {}
    kwargs = DistributedDataParallelKwargs(comm_hook=hook, comm_state_option=state)
    accelerator = Accelerator(kwargs_handlers=[kwargs])
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
    # Parameters only: each rank updates its BatchNorm statistics in its last forward, after the buffers' broadcast.
    return losses, [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


@pytest.mark.native
@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_with_each_comm_hook_trains_as_on_gloo(monkeypatch, hook):
    shared = run_on_ranks(_ddp_training, 2, hook, True)
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")
    plain = run_on_ranks(_ddp_training, 2, hook, False)
    for rank in range(2):
        assert shared[rank][0] == pytest.approx(plain[rank][0], rel=1e-4, abs=1e-5)
        for ours, theirs in zip(shared[rank][1], plain[rank][1]):
            assert torch.allclose(ours.double(), theirs.double(), rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(shared[0][1], shared[1][1]):  # the replicas stay identical
        assert torch.equal(ours, theirs)


def _fsdp2_training(share: bool, steps: int = 3) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    from accel.wire.shm_process_group import share_memory_in_default_group

    PartialState()
    assert (share_memory_in_default_group() is not None) == share
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_ddp_trains_on_gloo_when_memory_is_not_shared(monkeypatch):
    # ACCEL_TRANSPORT=torch, or no extension (ACCEL_DISABLE_NATIVE=1): plain gloo, and training works as in HF.
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")
    results = run_on_ranks(_ddp_training, 2, "fp16", False)
    assert all(loss == loss for loss in results[0][0])
    for ours, theirs in zip(results[0][1], results[1][1]):
        assert torch.equal(ours, theirs)


@pytest.mark.native
def test_fsdp2_trains_as_on_gloo(monkeypatch):
    shared = run_on_ranks(_fsdp2_training, 2, True, timeout=120)
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")
    plain = run_on_ranks(_fsdp2_training, 2, False, timeout=120)
    for rank in range(2):
        assert shared[rank] == pytest.approx(plain[rank], rel=1e-5, abs=1e-6)


@pytest.mark.native
def test_the_backend_is_registered_for_cpu_by_name():
    import accel.wire.shm_process_group  # noqa: F401  (registers it)

    assert dist.Backend.ACCEL == "accel" and dist.Backend.backend_capability["accel"] == ["cpu"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # registering takes over no default
