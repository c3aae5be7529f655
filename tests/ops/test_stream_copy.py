"""accel::stream_copy_, the staging copy of an asynchronous sharded save, against its reference torch._foreach_copy_
(bit for bit): small tensors (memcpy) and large ones (non-temporal stores, cut into chunks), unaligned starts and
odd lengths, strided pairs, several threads, and the errors that name the pair (opcheck: test_opcheck.py)."""

import pytest
import torch

pytestmark = pytest.mark.native

KIB = 1 << 10
# Bytes around the kernel's edges: memcpy below 256 KiB, chunks of 1 MiB above, lines of 64 bytes.
SIZES = (0, 1, 63, 64, 65, 256 * KIB - 1, 256 * KIB, 256 * KIB + 17, 1024 * KIB, 3 * 1024 * KIB + 5)


def _copy(targets, sources):
    from accel.ops import stream_copy_

    stream_copy_(targets, sources)


def _random_bytes(count, seed):
    return torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _pairs(offset=0):
    """Sources of every size in SIZES (starting `offset` bytes into their storage) and targets filled with other
    bytes, also `offset` bytes in: neither side starts on a cache line unless offset is 0."""
    sources = [_random_bytes(size + offset, seed)[offset:] for seed, size in enumerate(SIZES)]
    targets = [_random_bytes(size + offset, 100 + seed)[offset:] for seed, size in enumerate(SIZES)]
    return targets, sources


@pytest.mark.parametrize("offset", [0, 3, 16, 40])
def test_equals_the_reference_bit_for_bit(offset):
    targets, sources = _pairs(offset)
    expected = [target.clone() for target in targets]
    torch._foreach_copy_(expected, sources)
    _copy(targets, sources)
    for size, target, wanted in zip(SIZES, targets, expected):
        assert torch.equal(target, wanted), f"{size} bytes"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_every_dtype_keeps_its_bits(dtype):
    source = _random_bytes(600 * KIB * 8, 1).view(torch.float64).view(dtype)  # NaN payloads included for floats
    target = torch.zeros_like(source)
    _copy([target], [source])
    assert torch.equal(target.view(torch.uint8), source.view(torch.uint8))


def test_strided_pairs_are_copied_as_the_reference_does():
    source = torch.randn(512, 300)
    targets = [torch.empty(300, 512).t(), torch.empty(512, 300)]
    sources = [source, source.t().contiguous().t()]
    _copy(targets, sources)
    assert all(torch.equal(target, source) for target in targets)


def test_several_threads_copy_the_same_bytes():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        targets, sources = _pairs(5)
        _copy(targets, sources)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(target, source) for target, source in zip(targets, sources))


@pytest.mark.parametrize(
    ("targets", "sources", "message"),
    [
        ([torch.empty(3)], [], "1 targets but 0 sources"),
        ([torch.empty(3)], [torch.empty(3, dtype=torch.float64)], r"targets\[0\] is Float but sources\[0\] is Double"),
        ([torch.empty(4)], [torch.empty(3)], r"targets\[0\] has shape \[4\] but sources\[0\] has shape \[3\]"),
    ],
)
def test_bad_pairs_are_named(targets, sources, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.accel.stream_copy_.default(targets, sources)


def test_a_target_overlapping_its_source_is_refused():
    storage = torch.arange(1 << 18, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"targets\[0\] and sources\[0\] share memory"):
        _copy([storage[1:]], [storage[:-1]])


def test_a_bad_pair_leaves_every_target_as_it_was():
    first = torch.zeros(300_000)
    with pytest.raises(RuntimeError, match=r"targets\[1\] is Float but sources\[1\] is Double"):
        _copy([first, torch.empty(3)], [torch.ones(300_000), torch.empty(3, dtype=torch.float64)])
    assert not first.any()
