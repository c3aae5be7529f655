"""accel::reduce_in_order_, the arithmetic of the shared-memory process group, in one process: every op and dtype
against torch reducing in the same order (bit for bit), vector tails, the parallel split, odd layouts (opcheck:
test_opcheck.py)."""

import pytest
import torch

pytestmark = pytest.mark.native

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
SUPPORTED = [(op, dtype) for op in ("sum", "product", "min", "max") for dtype in (*FLOATS, *INTS, torch.bool)]
SUPPORTED += [(op, dtype) for op in ("avg", "premul_sum") for dtype in FLOATS]
SUPPORTED += [(op, dtype) for op in ("band", "bor", "bxor") for dtype in (*INTS, torch.bool)]
FACTOR = 0.1  # not a power of two: its rounding shows if it were applied per part


def _reduce(parts, op, out, factor=FACTOR):
    from accel.ops import reduce_in_order_

    reduce_in_order_(parts, op, out, factor)
    return out


def _sample(dtype, numel, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    if dtype.is_floating_point:
        values = torch.randn(numel, generator=generator, dtype=torch.float64) * 4
        values[::97] = torch.tensor([float("inf"), -0.0, 1e-40])[torch.arange(values[::97].numel()) % 3].double()
        return values.to(dtype)
    return torch.randint(-128 if dtype != torch.uint8 else 0, 128, (numel,), generator=generator).to(dtype)


def _expected(parts, op, factor=FACTOR):
    """Left to right in torch, fp16/bf16 in fp32: the same operations in the same order as the kernels."""
    dtype = parts[0].dtype
    if dtype == torch.bool:
        combine = {
            "sum": torch.logical_or,
            "max": torch.logical_or,
            "bor": torch.logical_or,
            "product": torch.logical_and,
            "min": torch.logical_and,
            "band": torch.logical_and,
            "bxor": torch.logical_xor,
        }[op]
    else:
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
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    result = parts[0].to(wide)
    for part in parts[1:]:
        result = combine(result, part.to(wide))
    if op == "avg":
        result = result / len(parts)
    if op == "premul_sum":
        result = result * factor
    return result.to(dtype)


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("op", "dtype"), SUPPORTED, ids=[f"{op}-{str(d)[6:]}" for op, d in SUPPORTED])
def test_matches_torch_in_rank_order_bit_for_bit(op, dtype):
    for count in (1, 2, 3, 5):
        for numel in (0, 1, 7, 65, 4097):
            parts = [_sample(dtype, numel, seed=count * 100 + r) for r in range(count)]
            out = _reduce(parts, op, torch.empty(numel, dtype=dtype))
            assert _same_bits(out, _expected(parts, op)), (count, numel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_the_thread_split_changes_no_bit(dtype):
    parts = [_sample(dtype, 600_001, seed=r) for r in range(3)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = _reduce(parts, "sum", torch.empty_like(parts[0]))
        torch.set_num_threads(2)
        parallel = _reduce(parts, "sum", torch.empty_like(parts[0]))
    finally:
        torch.set_num_threads(threads)
    assert _same_bits(serial, parallel) and _same_bits(serial, _expected(parts, "sum"))


def test_strided_parts_and_output_and_output_as_a_part():
    parts = [torch.randn(6, 4).t(), torch.randn(12, 4)[::2].t()]
    out = torch.empty(6, 4).t()
    _reduce(parts, "max", out)
    assert torch.equal(out, torch.maximum(parts[0], parts[1]))
    a, b = torch.randn(1000), torch.randn(1000)
    expected = a + b
    _reduce([a, b], "sum", a)  # out may be one of the parts
    assert torch.equal(a, expected)


def test_bad_arguments_name_the_problem():
    a = torch.ones(4)
    with pytest.raises(RuntimeError, match="unknown reduction 'mean'"):
        _reduce([a], "mean", torch.empty(4))
    with pytest.raises(RuntimeError, match="no 'avg' reduction of Int"):
        _reduce([a.int()], "avg", torch.empty(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"parts\[1\] is Double but out is Float"):
        _reduce([a, a.double()], "sum", torch.empty(4))
    with pytest.raises(RuntimeError, match=r"parts\[0\] has 4 elements but out has 5"):
        _reduce([a], "sum", torch.empty(5))
    with pytest.raises(RuntimeError, match="at least one part"):
        _reduce([], "sum", torch.empty(5))
