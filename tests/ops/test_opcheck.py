"""`torch.library.opcheck` on every op of `torch.ops.accel` (schema, autograd registration, fake kernel, AOT tracing).

The ops are read from the dispatcher, not listed here, so an op added to csrc/ops.cpp cannot skip this: one without
samples in SAMPLES fails `test_every_op_has_samples`. The op-specific files compare each op with its pure-torch
reference. On a GPU (tests marked gpu), every op with a CUDA kernel is opchecked on the same samples moved there.
At the end: the ops with kernels under torch.compile, against their eager results.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Callable

import pytest
import torch

from accel import ops

pytestmark = pytest.mark.native

EVERY_CHECK = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# Ops whose call changes the process's shared-memory groups (or whose outputs depend on other ranks) give another
# result each time they run, so tracing cannot replay them: everything but the AOT check.
UNTRACEABLE = EVERY_CHECK[:3]


@dataclasses.dataclass
class Sample:
    args: tuple
    checks: tuple[str, ...] = EVERY_CHECK


class Resources:
    """What samples need: a folder for the file ops and shared-memory groups of one process (all destroyed after,
    those opcheck creates itself included: handles are numbered in order)."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.fds: list[int] = []  # files samples opened
        self.first_group = self._create()

    def _create(self) -> int:
        return ops.shm_group_create(0, 1, secrets.token_hex(16), 4096, 10.0)

    def created_group(self) -> int:
        return self._create()

    def ready_group(self) -> int:
        handle = self._create()
        ops.shm_group_attach(handle, ops.shm_group_locator(handle))
        ops.shm_group_finish_setup(handle)
        return handle

    def close(self) -> None:
        for handle in range(self.first_group, self._create() + 1):
            ops.shm_group_destroy(handle)  # a handle already destroyed is ignored
        for fd in self.fds:
            os.close(fd)

    def open(self, path, flags: int) -> int:
        self.fds.append(os.open(path, flags, 0o644))
        return self.fds[-1]


def _pad_into(res: Resources) -> list[Sample]:
    def sample(src, dim, size, pad_value, pad_first):
        shape = list(src.shape)
        shape[dim] = size
        return Sample((src, dim, pad_value, pad_first, torch.empty(shape, dtype=src.dtype)))

    return [
        sample(torch.randn(3, 4), 1, 6, -1.0, False),
        sample(torch.randn(2, 3, 5), 0, 4, 0, True),
        sample(torch.randint(0, 9, (4,), dtype=torch.int64), 0, 7, 3, False),
        sample(torch.tensor([True, False]), 0, 5, False, True),
        sample(torch.randn(5, 2, dtype=torch.bfloat16), -2, 8, 1.5, False),
    ]


def _grads(seed: int) -> list[torch.Tensor]:
    """Sizes around the vector width and the chunk size, in every dtype the kernels take."""
    generator = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    sizes = [0, 1, 17, 4096, 40_000, 7, 100_003, 3]
    return [(torch.randn(size, generator=generator) * 1000).to(dtypes[i % 3]) for i, size in enumerate(sizes)]


def _unscale_grads(res: Resources) -> list[Sample]:
    grads = _grads(7)
    return [Sample((grads, torch.zeros(()), torch.tensor(0.5), torch.empty(len(grads), dtype=torch.float64)))]


def _clip_grads(res: Resources) -> list[Sample]:
    return [Sample((_grads(8), torch.tensor(40.0), 1.0)), Sample(([], torch.tensor(1.0), 1.0))]


def _safetensors_file(res: Resources) -> tuple[str, torch.Tensor, torch.Tensor]:
    """A path, an 8-byte-aligned header for one float32 tensor of 5 elements, and that tensor."""
    body = b'{"w":{"dtype":"F32","shape":[5],"data_offsets":[0,20]}}'
    body += b" " * (-len(body) % 8)
    header = len(body).to_bytes(8, "little") + body
    return str(res.tmp_path / "w.safetensors"), torch.frombuffer(bytearray(header), dtype=torch.uint8), torch.randn(5)


def _status() -> torch.Tensor:
    return torch.tensor([0, -1], dtype=torch.int64)


def _write_tensors(res: Resources) -> list[Sample]:
    path, header, tensor = _safetensors_file(res)
    return [Sample((res.open(path, os.O_WRONLY | os.O_CREAT), path, header, [tensor], [0], _status()))]


def _read_tensors(res: Resources) -> list[Sample]:
    path, header, tensor = _safetensors_file(res)
    ops.write_tensors_(res.open(path, os.O_WRONLY | os.O_CREAT), path, header, [tensor], [0])
    return [Sample((res.open(path, os.O_RDONLY), path, [header.numel()], [torch.empty(5)], _status()))]


def _map_file_leased(res: Resources) -> list[Sample]:
    path = res.tmp_path / "mapped.bin"
    path.write_bytes(bytes(range(256)) * 20)
    fd = res.open(path, os.O_RDONLY)
    # Each call makes a new mapping under a new lease (not a function of its inputs): no AOT check.
    return [Sample((fd, 5000, str(path)), UNTRACEABLE), Sample((fd, 1, str(path)), UNTRACEABLE)]


def _shm_group_create(res: Resources) -> list[Sample]:
    return [Sample((0, 1, secrets.token_hex(16), 4096, 10.0, False), UNTRACEABLE)]


def _shm_group_locator(res: Resources) -> list[Sample]:
    return [Sample((res.created_group(),), UNTRACEABLE)]


def _shm_group_attach(res: Resources) -> list[Sample]:
    handle = res.created_group()
    return [Sample((handle, ops.shm_group_locator(handle)), UNTRACEABLE)]


def _shm_group_finish_setup(res: Resources) -> list[Sample]:
    return [Sample((res.ready_group(),), UNTRACEABLE)]


def _shm_group_destroy(res: Resources) -> list[Sample]:
    return [Sample((res.ready_group(),), UNTRACEABLE)]


LEAVES = [
    [torch.arange(12, dtype=torch.float32).view(3, 4)],
    [torch.ones(5, dtype=torch.bool), torch.zeros(0, 2, dtype=torch.int64), torch.randn(3, 4, 5)[:, ::2]],
    [torch.randn(3000, 3)],  # several 4 KiB rounds
]


def _shm_all_gather(res: Resources) -> list[Sample]:
    group = res.ready_group()
    return [
        Sample((group, leaves, pad_dim, pad_value, pad_first, "gather"))
        for leaves in LEAVES
        for pad_dim, pad_value, pad_first in ((None, 0, False), (-1, 1.5, True))
    ]


def _shm_all_gather_bytes(res: Resources) -> list[Sample]:
    data = torch.arange(10000, dtype=torch.int64).to(torch.uint8)
    return [Sample((res.ready_group(), data, "gather_object")), Sample((res.ready_group(), data[:0], "barrier"))]


def _shm_pad_across_processes(res: Resources) -> list[Sample]:
    # Which leaves come back padded depends on the other ranks: the fake kernel says so and the op is tagged
    # dynamic_output_shape (opcheck's fake-tensor comparison skips it); it cannot be traced.
    group = res.ready_group()
    return [Sample((group, leaves, 0, 1, False), UNTRACEABLE) for leaves in LEAVES]


def _reduce_in_order(res: Resources) -> list[Sample]:
    return [
        Sample(([torch.randn(5), torch.randn(5)], "sum", torch.empty(5), 1.0)),
        Sample(([torch.randn(3, 4).to(torch.bfloat16)] * 3, "avg", torch.empty(3, 4, dtype=torch.bfloat16), 1.0)),
        Sample(([torch.randint(0, 9, (17,))] * 2, "bxor", torch.empty(17, dtype=torch.int64), 1.0)),
        Sample(([torch.randn(2, 3).t(), torch.randn(3, 2)], "premul_sum", torch.empty(3, 2), 0.5)),
    ]


def _stream_copy(res: Resources) -> list[Sample]:
    large = torch.randn(300_000)  # above the kernel's non-temporal threshold
    return [
        Sample(([torch.empty(5), torch.empty(2, 3)], [torch.randn(5), torch.randn(2, 3)])),
        Sample(([torch.empty_like(large)], [large])),
        Sample(([torch.empty(4, 3).t()], [torch.randn(3, 4)])),
    ]


# Every op of the namespace -> its samples (given the test's Resources).
SAMPLES: dict[str, Callable[[Resources], list[Sample]]] = {
    "pad_into": _pad_into,
    "unscale_grads_": _unscale_grads,
    "clip_grads_": _clip_grads,
    "write_tensors_": _write_tensors,
    "read_tensors_": _read_tensors,
    "map_file_leased": _map_file_leased,
    "shm_group_create": _shm_group_create,
    "shm_group_locator": _shm_group_locator,
    "shm_group_attach": _shm_group_attach,
    "shm_group_finish_setup": _shm_group_finish_setup,
    "shm_group_destroy": _shm_group_destroy,
    "shm_all_gather": _shm_all_gather,
    "shm_all_gather_bytes": _shm_all_gather_bytes,
    "shm_pad_across_processes": _shm_pad_across_processes,
    "reduce_in_order_": _reduce_in_order,
    "stream_copy_": _stream_copy,
}


def registered_ops() -> list[str]:
    """The names of every op the dispatcher knows in the accel namespace (what the extension registered)."""
    names = torch._C._dispatch_get_all_op_names()
    return sorted(name.split("::", 1)[1] for name in names if name.startswith("accel::"))


def test_every_op_has_samples():
    ops_here = registered_ops()
    assert ops_here, "no accel op is registered although the extension loaded"
    assert sorted(set(ops_here) - SAMPLES.keys()) == [], "ops without opcheck samples: add them to SAMPLES"
    assert sorted(SAMPLES.keys() - set(ops_here)) == [], "SAMPLES names ops the extension does not register"


@pytest.fixture
def resources(tmp_path):
    res = Resources(tmp_path)
    yield res
    res.close()


@pytest.mark.parametrize("op_name", sorted(SAMPLES))
def test_opcheck(op_name, resources):
    samples = SAMPLES[op_name](resources)
    assert samples, f"{op_name}: no samples"
    for sample in samples:
        torch.library.opcheck(getattr(torch.ops.accel, op_name).default, sample.args, test_utils=sample.checks)


# --- on the GPU ------------------------------------------------------------------------------------------------------

# The ops with CUDA kernels (csrc/cuda/*.cu); test_every_cuda_kernel_is_checked keeps this list true.
CUDA_OPS = ("clip_grads_", "pad_into", "read_tensors_", "unscale_grads_", "write_tensors_")


# The arguments the file ops take on the CPU whatever the device of the tensors: the header, the status.
HOST_ARGUMENTS = {"write_tensors_": (2, 5), "read_tensors_": (4,)}


def on_cuda(op_name: str, sample: Sample) -> Sample:
    """The sample with every tensor on the GPU, except the file ops' header and status (HOST_ARGUMENTS)."""

    def move(value, position):
        if isinstance(value, list):
            return [move(item, None) for item in value]
        if isinstance(value, torch.Tensor) and position not in HOST_ARGUMENTS.get(op_name, ()):
            return value.cuda()
        return value

    return Sample(tuple(move(value, i) for i, value in enumerate(sample.args)), sample.checks)


@pytest.mark.native_cuda
def test_every_cuda_kernel_is_checked():
    from accel import _ext

    assert [op for op in registered_ops() if _ext.has_kernel(op, "CUDA")] == list(CUDA_OPS)


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("op_name", CUDA_OPS)
def test_opcheck_on_cuda(op_name, resources):
    for sample in SAMPLES[op_name](resources):
        moved = on_cuda(op_name, sample)
        torch.library.opcheck(getattr(torch.ops.accel, op_name).default, moved.args, test_utils=moved.checks)


# --- torch.compile ---------------------------------------------------------------------------------------------------
# Each op with a kernel in a compiled function (fullgraph: no graph break) gives what it gives eagerly, bit for bit.
# The CPU runs aot_eager (functionalization and the fake kernels, what every backend starts from); the GPU inductor.

COMPILERS = [
    pytest.param("cpu", "aot_eager", id="cpu-aot_eager"),
    pytest.param("cuda", "inductor", id="cuda-inductor", marks=[pytest.mark.gpu, pytest.mark.native_cuda]),
]


def compiled(fn: Callable, backend: str) -> Callable:
    import torch._inductor.config

    torch._dynamo.reset()  # no graph of an earlier test (another device, another backend) is reused
    compiled_fn = torch.compile(fn, backend=backend, fullgraph=True)

    def run(*args):
        # Compiled in this process: a pool of compile workers would outlive the test (conftest fails a test for it).
        with torch._inductor.config.patch(compile_threads=1):
            return compiled_fn(*args)

    return run


def _pad_both_ways(src, out_last, out_first):
    ops.pad_into(src, 1, -1.5, False, out_last)
    ops.pad_into(src, 0, 7, True, out_first)
    return out_last.sum(dtype=torch.float64)


def _unscale_then_clip(grads, found_inf, inv_scale, sq_norms, total_norm):
    ops.unscale_grads_(grads, found_inf, inv_scale, sq_norms)
    ops.clip_grads_(grads, total_norm, 0.5)
    return sq_norms * 1


def _run_twice(fn: Callable, make_args: Callable, backend: str) -> tuple:
    """(eager arguments after the call, its result), (compiled arguments after the call, its result)."""
    eager_args, compiled_args = make_args(), make_args()
    return (eager_args, fn(*eager_args)), (compiled_args, compiled(fn, backend)(*compiled_args))


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        as_bytes = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*as_bytes)
    return a == b


@pytest.mark.parametrize("device,backend", COMPILERS)
def test_pad_into_under_torch_compile(device, backend):
    generator = torch.Generator().manual_seed(30)
    src = torch.randn(37, 101, generator=generator).to(device)

    def make_args():
        return src.clone(), torch.empty(37, 130, device=device), torch.empty(40, 101, device=device)

    (eager_args, eager), (compiled_args, result) = _run_twice(_pad_both_ways, make_args, backend)
    assert _same(compiled_args, eager_args) and _same(result, eager)


@pytest.mark.parametrize("device,backend", COMPILERS)
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_unscale_and_clip_under_torch_compile(device, backend, poison):
    grads = [g.to(device) for g in _grads(31)]
    if poison is not None:
        grads[4][1234] = poison

    def make_args():
        copies = [g.clone() for g in grads]
        return (
            copies,
            torch.zeros((), device=device),
            torch.tensor(0.25, device=device),
            torch.empty(len(copies), dtype=torch.float64, device=device),
            torch.tensor(40.0, device=device),
        )

    (eager_args, eager), (compiled_args, result) = _run_twice(_unscale_then_clip, make_args, backend)
    assert _same(compiled_args[:2], eager_args[:2]) and _same(result, eager)
    assert compiled_args[1].item() == (0.0 if poison is None else 1.0)


def _write(fd, path, header, tensors, offsets, status):
    # The op itself: its wrapper raises a failed call's OSError eagerly (a graph break, refused by fullgraph).
    torch.ops.accel.write_tensors_.default(fd, path, header, tensors, offsets, status)
    return tensors[0] * 1  # an output: dynamo compiles no graph for a function without tensor work


def _read(fd, path, offsets, outs, status):
    torch.ops.accel.read_tensors_.default(fd, path, offsets, outs, status)
    return outs[0] * 1


@pytest.mark.parametrize("device,backend", COMPILERS)
def test_file_ops_under_torch_compile(device, backend, tmp_path):
    """The write, whose only output is its status, is kept (it is registered as effectful)."""
    res = Resources(tmp_path)
    try:
        path, header, tensor = _safetensors_file(res)
        status = _status()
        fd = res.open(path, os.O_WRONLY | os.O_CREAT)
        compiled(_write, backend)(fd, path, header, [tensor.to(device)], [0], status)
        assert os.path.getsize(path) == header.numel() + tensor.numel() * 4, "the compiled program did not write"
        assert status.tolist() == [0, -1]
        eager = torch.empty(5, device=device)
        ops.read_tensors_(res.open(path, os.O_RDONLY), path, [header.numel()], [eager])
        assert _same(eager.cpu(), tensor)
        out = torch.empty(5, device=device)
        result = compiled(_read, backend)(res.open(path, os.O_RDONLY), path, [header.numel()], [out], status)
        assert _same(out, eager) and _same(result, eager) and status.tolist() == [0, -1]
    finally:
        res.close()
