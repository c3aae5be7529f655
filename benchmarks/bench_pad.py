"""accel::pad_into (the pack step of the padded all-gather) against the reference, HF's expression and a copy.

Each group is one shape; `limit` copies the same bytes into a fresh buffer (the floor for this job: the
output must be allocated and written once). Ratios against it are printed after the table.

Run: .venv/bin/pytest benchmarks/bench_pad.py --benchmark-only -p no:cacheprovider
"""

import pytest
import torch

from accel import _ext
from accel.collectives import pad_reference

CASES = {  # name: (shape, dim, padded size along dim)
    "4KiB-dim0": ((32, 32), 0, 36),
    "1MiB-dim0": ((512, 512), 0, 563),
    "64MiB-dim0": ((4096, 4096), 0, 4505),
    "64MiB-dim1": ((4096, 4096), 1, 4505),
}


def hf_pad(tensor, dim, size, pad_index=0):
    """A replica of the padding lines of HF Accelerate's pad_across_processes, once the sizes are known:
    new_zeros + pad_index, then a slice copy. The collective around it is measured in the all-gather suite."""
    new_size = list(tensor.shape)
    new_size[dim] = size
    new_tensor = tensor.new_zeros(tuple(new_size)) + pad_index
    indices = tuple(slice(0, tensor.shape[dim]) if i == dim else slice(None) for i in range(len(new_size)))
    new_tensor[indices] = tensor
    return new_tensor


def native_pad(tensor, dim, size, pad_value=0):
    shape = list(tensor.shape)
    shape[dim] = size
    out = torch.empty(shape, dtype=tensor.dtype)
    torch.ops.accel.pad_into(tensor, dim, pad_value, False, out)
    return out


def limit_copy(tensor, dim, size):
    """The bytes the pad must write, moved by one plain copy into a fresh buffer: the floor."""
    shape = list(tensor.shape)
    shape[dim] = size
    return torch.empty(shape, dtype=tensor.dtype).view(-1)[: tensor.numel()].copy_(tensor.view(-1))


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request):
    shape, dim, size = CASES[request.param]
    return request.param, torch.randn(shape), dim, size


def run(benchmark, case, fn):
    name, tensor, dim, size = case
    benchmark.group = f"pad {name}"
    benchmark(fn, tensor, dim, size)


@pytest.mark.skipif(not _ext.status().loaded, reason="native extension not loaded")
def test_native(benchmark, case):
    run(benchmark, case, native_pad)


def test_reference(benchmark, case):
    run(benchmark, case, pad_reference)


def test_hf_accelerate_replica(benchmark, case):
    run(benchmark, case, hf_pad)


def test_limit(benchmark, case):
    run(benchmark, case, limit_copy)
