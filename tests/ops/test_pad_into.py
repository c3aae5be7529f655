"""accel::pad_into against its pure-torch reference, bit for bit, plus bad input and the CUDA opcheck (the CPU one:
test_opcheck.py)."""

import itertools

import pytest
import torch

from accel import _ext
from accel.collectives import pad_reference, pad_tensor

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
PAD_VALUES = {torch.bool: [False, True], torch.uint8: [0, 7]}


def random_tensor(shape, dtype, generator):
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator).to(dtype)


def same_bits(a, b):
    """Bit-exact equality (NaN == NaN, -0.0 != 0.0), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def cases():
    shapes = [(5,), (3, 4), (2, 3, 5), (4, 1, 3), (0, 3), (3, 0)]
    for shape, dtype, pad_first in itertools.product(shapes, DTYPES, (False, True)):
        for dim in range(-len(shape), len(shape)):
            yield shape, dtype, dim, pad_first


def native_pad(tensor, dim, size, pad_value, pad_first):
    shape = list(tensor.shape)
    shape[dim] = size
    out = torch.empty(shape, dtype=tensor.dtype)
    torch.ops.accel.pad_into(tensor, dim, pad_value, pad_first, out)
    return out


@pytest.mark.native
@pytest.mark.parametrize("shape,dtype,dim,pad_first", list(cases()), ids=str)
def test_native_matches_reference(shape, dtype, dim, pad_first):
    generator = torch.Generator().manual_seed(0)
    src = random_tensor(shape, dtype, generator)
    for extra in (0, 1, 3):
        size = shape[dim] + extra
        for pad_value in PAD_VALUES.get(dtype, [0, -1, 2.5] if dtype.is_floating_point else [0, -1]):
            expected = pad_reference(src, dim, size, pad_value, pad_first)
            assert same_bits(native_pad(src, dim, size, pad_value, pad_first), expected)


@pytest.mark.native
@pytest.mark.parametrize("num_threads", [2, 7])
@pytest.mark.parametrize("dim", [0, 1])
def test_native_parallel_chunks_match_reference(num_threads, dim):
    # Large enough that parallel_for splits rows at arbitrary element boundaries.
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        src = torch.randn(3, 100_003, generator=torch.Generator().manual_seed(1))
        size = src.shape[dim] + (2 if dim == 0 else 49_998)
        for pad_first in (False, True):
            expected = pad_reference(src, dim, size, float("nan"), pad_first)
            assert same_bits(native_pad(src, dim, size, float("nan"), pad_first), expected)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.native
def test_native_reads_non_contiguous_src_and_writes_into_a_buffer_view():
    src = torch.arange(24, dtype=torch.int32).view(4, 6).t()  # non-contiguous (6, 4)
    buffer = torch.full((100,), 99, dtype=torch.int32)
    out = buffer[10 : 10 + 6 * 7].view(6, 7)  # a contiguous view inside a bigger buffer, like a pack slot
    torch.ops.accel.pad_into(src, 1, -5, True, out)
    assert same_bits(out, pad_reference(src, 1, 7, -5, True))
    assert (buffer[:10] == 99).all() and (buffer[52:] == 99).all()


def test_pad_tensor_matches_reference_in_either_mode():
    src = torch.tensor([[1, 2], [3, 4]], dtype=torch.int16)
    expected = torch.tensor([[1, 2], [3, 4], [9, 9], [9, 9]], dtype=torch.int16)
    assert same_bits(pad_tensor(src, 0, 4, 9), expected)
    assert same_bits(pad_tensor(src.bool(), -1, 3, True, pad_first=True), torch.ones(2, 3, dtype=torch.bool))


def test_reference_keeps_dtype_where_hf_promotes():
    # HF's new_zeros(...) + pad_index turns bool into int64; accel keeps the dtype (bool included).
    padded = pad_reference(torch.tensor([True, False]), 0, 3, 1)
    assert padded.dtype == torch.bool and padded.tolist() == [True, False, True]


@pytest.mark.native
@pytest.mark.parametrize(
    "src,dim,out,message",
    [
        (torch.zeros(2, 3), 0, torch.zeros(1, 3), "is smaller than src.size"),
        (torch.zeros(2, 3), 0, torch.zeros(4, 2), "must equal src.size"),
        (torch.zeros(2, 3), 0, torch.zeros(4, 3, dtype=torch.float64), "dtype mismatch"),
        (torch.zeros(2, 3), 0, torch.zeros(3, 4).t(), "out must be contiguous"),
        (torch.zeros(2, 3), 0, torch.zeros(4), "dims but out has"),
        (torch.tensor(1.0), 0, torch.zeros(2), "0-d tensor"),
    ],
)
def test_native_rejects_bad_input_with_a_clear_message(src, dim, out, message):
    before = out.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.accel.pad_into(src, dim, 0, False, out)
    assert same_bits(out, before)  # nothing written


@pytest.mark.native
def test_native_rejects_out_of_range_dim():
    with pytest.raises(IndexError, match="Dimension out of range"):
        torch.ops.accel.pad_into(torch.zeros(2, 3), 2, 0, False, torch.zeros(2, 3))


@pytest.mark.native
def test_native_rejects_pad_value_that_overflows_dtype():
    with pytest.raises(RuntimeError, match="overflow"):
        native_pad(torch.zeros(2, dtype=torch.int8), 0, 3, 1000, False)


@pytest.mark.gpu
@pytest.mark.native
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_reference(dtype):
    if not _ext.native_for("pad_into", "cuda"):
        pytest.skip("accel._C was built without CUDA kernels")
    generator = torch.Generator().manual_seed(2)
    src = random_tensor((37, 1001), dtype, generator).cuda()
    for dim, pad_first in itertools.product((0, 1), (False, True)):
        size = src.shape[dim] + 5
        shape = list(src.shape)
        shape[dim] = size
        out = torch.empty(shape, dtype=dtype, device="cuda")
        torch.ops.accel.pad_into(src, dim, 1, pad_first, out)
        assert same_bits(out.cpu(), pad_reference(src.cpu(), dim, size, 1, pad_first))
        torch.library.opcheck(torch.ops.accel.pad_into.default, (src, dim, 1, pad_first, out))


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_reference_in_every_case(dtype):
    """Every shape, dim, side, extra size and pad value of the CPU test above, on the GPU, against the reference;
    through the op and through pad_tensor (the padded gather's pack step), which takes the kernel on a GPU."""
    generator = torch.Generator().manual_seed(0)
    for shape, case_dtype, dim, pad_first in cases():
        if case_dtype != dtype:
            continue
        src = random_tensor(shape, dtype, generator)
        for extra in (0, 1, 3):
            size = shape[dim] + extra
            for pad_value in PAD_VALUES.get(dtype, [0, -1, 2.5] if dtype.is_floating_point else [0, -1]):
                expected = pad_reference(src, dim, size, pad_value, pad_first)
                shape_out = list(shape)
                shape_out[dim] = size
                out = torch.empty(shape_out, dtype=dtype, device="cuda")
                torch.ops.accel.pad_into(src.cuda(), dim, pad_value, pad_first, out)
                assert same_bits(out.cpu(), expected), (shape, dim, pad_first, extra, pad_value)
                assert same_bits(pad_tensor(src.cuda(), dim, size, pad_value, pad_first).cpu(), expected)


@pytest.mark.gpu
@pytest.mark.native_cuda
def test_cuda_reads_non_contiguous_src_writes_into_a_view_and_strides_over_a_large_grid():
    src = torch.arange(24, dtype=torch.int32, device="cuda").view(4, 6).t()  # non-contiguous (6, 4)
    buffer = torch.full((100,), 99, dtype=torch.int32, device="cuda")
    out = buffer[10 : 10 + 6 * 7].view(6, 7)
    torch.ops.accel.pad_into(src, 1, -5, True, out)
    assert same_bits(out.cpu(), pad_reference(src.cpu(), 1, 7, -5, True))
    assert (buffer[:10] == 99).all() and (buffer[52:] == 99).all()
    # More elements than the grid's threads (32 blocks of 256 per SM): each thread pads several.
    big = torch.randn(3, 1_000_003, generator=torch.Generator().manual_seed(5))
    for dim, size in ((0, 5), (1, 1_200_000)):
        for pad_first in (False, True):
            padded = pad_tensor(big.cuda(), dim, size, float("nan"), pad_first)
            assert same_bits(padded.cpu(), pad_reference(big, dim, size, float("nan"), pad_first))
