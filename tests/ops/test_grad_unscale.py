"""accel::unscale_grads_ and accel::clip_grads_ against torch: unscale and found_inf bit for bit, the norm to
rounding, the clip bit for bit given the same norm; the CUDA opcheck (the CPU one: test_opcheck.py); bad input;
every CPU instruction set."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from accel import _ext
from accel.precision import grads as grad_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INV_SCALES = [1.0, 2.0**-16, 0.37, 4.0]  # 1: the read-only path; 4: fp16 values may overflow *after* the check


def gradient_set(kind, dtypes, generator, device="cpu"):
    """Many tiny tensors, a few large ones (sizes off the vector width), or both; dtypes drawn from `dtypes`."""
    sizes = {
        "tiny": torch.randint(1, 70, (300,), generator=generator).tolist(),
        "large": [300_001, 65_537, 131_072],
        "mixed": [0, 1, 17, 4096, 40_000, 7, 100_003, 3],
    }[kind]
    grads = []
    for i, size in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        grads.append((torch.randn(size, generator=generator) * 1000).to(dtype).to(device))
    return grads


def inject(grads, value, where, generator):
    """Puts `value` at the first, last or a middle element of a random non-empty tensor."""
    candidates = [g for g in grads if g.numel() > 0]
    grad = candidates[torch.randint(len(candidates), (1,), generator=generator).item()]
    index = {"first": 0, "last": grad.numel() - 1, "middle": grad.numel() // 2}[where]
    grad.view(-1)[index] = value


def torch_unscale(grads, inv_scale, found_inf_init=0.0):
    """torch._amp_foreach_non_finite_check_and_unscale_ per dtype (it takes one dtype per call). torch's CUDA kernel
    has no bf16: bf16 GPU grads are unscaled by its CPU kernel (the same fp32 arithmetic) and copied back."""
    grads = [g.clone() for g in grads]
    device = grads[0].device if grads else torch.device("cpu")
    found_inf = torch.full((), found_inf_init, device=device)
    inv = torch.tensor(inv_scale, device=device)
    for dtype in DTYPES:
        group = [g for g in grads if g.dtype == dtype]
        if not group:
            continue
        if dtype == torch.bfloat16 and device.type == "cuda":
            on_cpu, cpu_inf = [g.cpu() for g in group], found_inf.cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(on_cpu, cpu_inf, inv.cpu())
            for g, unscaled in zip(group, on_cpu):
                g.copy_(unscaled)
            found_inf.copy_(cpu_inf)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
    return grads, found_inf


def native_unscale(grads, inv_scale, found_inf_init=0.0):
    grads = [g.clone() for g in grads]
    device = grads[0].device if grads else "cpu"
    found_inf = torch.full((), found_inf_init, device=device)
    sq_norms = torch.empty(len(grads), dtype=torch.float64, device=device)
    torch.ops.accel.unscale_grads_(grads, found_inf, torch.tensor(inv_scale, device=device), sq_norms)
    return grads, found_inf, sq_norms


def same_bits(a, b):
    """Bit-exact equality, except that any two NaNs are equal: NaN payloads are not part of the contract (torch's
    own kernel writes a bf16 NaN as 0x7fc0 on its scalar path and 0xffff on its vector path)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.equal(a[~both_nan].view(torch.uint8), b[~both_nan].view(torch.uint8))


def check_parity(grads, inv_scale, found_inf_init=0.0):
    expected, expected_inf = torch_unscale(grads, inv_scale, found_inf_init)
    actual, actual_inf, sq_norms = native_unscale(grads, inv_scale, found_inf_init)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert same_bits(a, e), f"grads[{i}] ({a.dtype}, {a.numel()} elements) differs from torch"
    assert same_bits(actual_inf, expected_inf)
    if not actual_inf.item():
        # The sums are of the fp32 products, before they are rounded to the gradient's dtype.
        inv = torch.tensor(inv_scale, dtype=torch.float32)
        exact = torch.stack([(g.float() * inv).double().square().sum() for g in grads]) if grads else sq_norms
        torch.testing.assert_close(sq_norms, exact, rtol=1e-5, atol=0)
    return actual_inf.item()


@pytest.mark.native
@pytest.mark.parametrize("kind", ["tiny", "large", "mixed"])
@pytest.mark.parametrize("dtypes", [[d] for d in DTYPES] + [DTYPES], ids=lambda d: "+".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("inv_scale", INV_SCALES)
def test_unscale_matches_torch_bit_for_bit(kind, dtypes, inv_scale):
    grads = gradient_set(kind, dtypes, torch.Generator().manual_seed(len(kind) + len(dtypes)))
    assert check_parity(grads, inv_scale) == 0.0


@pytest.mark.native
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
@pytest.mark.parametrize("kind", ["tiny", "large", "mixed"])
def test_inf_and_nan_set_found_inf_as_torch_does(value, where, kind):
    generator = torch.Generator().manual_seed(hash((str(value), where, kind)) % 1000)
    grads = gradient_set(kind, DTYPES, generator)
    inject(grads, value, where, generator)
    assert check_parity(grads, 2.0**-10) == 1.0


@pytest.mark.native
def test_found_inf_is_set_never_cleared():
    grads = gradient_set("mixed", DTYPES, torch.Generator().manual_seed(1))
    assert check_parity(grads, 0.5, found_inf_init=1.0) == 1.0


@pytest.mark.native
def test_empty_lists_and_empty_tensors():
    found_inf, sq_norms = torch.zeros(()), torch.empty(0, dtype=torch.float64)
    torch.ops.accel.unscale_grads_([], found_inf, torch.tensor(0.5), sq_norms)
    assert found_inf.item() == 0.0
    empty = [torch.empty(0), torch.empty(0, 3, dtype=torch.float16)]
    _, found_inf, sq_norms = native_unscale(empty, 0.5)
    assert found_inf.item() == 0.0 and sq_norms.tolist() == [0.0, 0.0]
    torch.ops.accel.clip_grads_([], torch.tensor(5.0), 1.0)


def tiny_bf16_values(count, generator):
    """bf16 values around and below fp32's normal range (2^-126): random signs, mantissas and exponents 0-24,
    denormals included, with some normal values and zeros mixed in."""
    sign = torch.randint(0, 2, (count,), generator=generator, dtype=torch.int32) << 15
    exponent = torch.randint(0, 25, (count,), generator=generator, dtype=torch.int32) << 7
    mantissa = torch.randint(0, 128, (count,), generator=generator, dtype=torch.int32)
    values = (sign | exponent | mantissa).to(torch.int16).view(torch.bfloat16)
    values[::17] = torch.randn(values[::17].shape, generator=generator).to(torch.bfloat16)
    values[::29] = 0.0
    return values


@pytest.mark.native
@pytest.mark.parametrize("inv_scale", [2.0**-16, 0.37, 1.0, 4.0])
def test_bf16_values_near_the_denormal_range_match_torch_bit_for_bit(inv_scale):
    """Where the CPU narrows bf16 with AVX512-BF16's instruction, which flushes denormals (torch rounds them), a
    vector holding one takes torch's rounding: unscale and clip still match torch bit for bit."""
    generator = torch.Generator().manual_seed(16)
    grads = [tiny_bf16_values(n, generator) for n in (1, 31, 32, 1000, 40_007)]
    assert check_parity(grads, inv_scale) == 0.0
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total_norm = torch.tensor(3e5)  # a clip coefficient of ~2^-17: more results fall below the normal range
    torch.nn.utils.clip_grad._clip_grads_with_norm_(params, 1.0, total_norm)
    actual = [g.clone() for g in grads]
    torch.ops.accel.clip_grads_(actual, total_norm, 1.0)
    assert all(same_bits(a, p.grad) for a, p in zip(actual, params))


@pytest.mark.native
@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_number_of_threads(dtype):
    """Threads claim chunks of the gradients in whatever order they get to run; each chunk's sum still lands in
    its fixed place, so grads, found_inf and the sums are the same with 1 thread as with 4 (on any core count)."""
    generator = torch.Generator().manual_seed(17)
    grads = [(torch.randn(n, generator=generator) * 1000).to(dtype) for n in (300_001, 7, 65_537, 131_072, 40_000)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = native_unscale(grads, 0.37)
        torch.set_num_threads(4)
        parallel = native_unscale(grads, 0.37)
    finally:
        torch.set_num_threads(threads)
    assert all(same_bits(a, b) for a, b in zip(serial[0], parallel[0]))
    assert serial[1].item() == parallel[1].item() == 0.0
    assert torch.equal(serial[2], parallel[2])


@pytest.mark.native
@pytest.mark.parametrize("dtypes", [[d] for d in DTYPES] + [DTYPES], ids=lambda d: "+".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("norm", [0.5, 3.0, 1e4, float("inf"), float("nan")])
def test_clip_matches_torch_bit_for_bit_given_the_norm(dtypes, norm):
    grads = gradient_set("mixed", dtypes, torch.Generator().manual_seed(3))
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total_norm = torch.tensor(norm)
    torch.nn.utils.clip_grad._clip_grads_with_norm_(params, 2.0, total_norm)
    actual = [g.clone() for g in grads]
    torch.ops.accel.clip_grads_(actual, total_norm, 2.0)
    for a, p in zip(actual, params):
        assert same_bits(a, p.grad)


@pytest.mark.native
# Two units in the last place of each dtype: torch's norm and clip coefficient are rounded to it, ours are fp32.
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 2**-9), (torch.bfloat16, 2**-6)])
@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_clip_grad_norm_agrees_with_torch_to_rounding(dtype, rtol, max_norm):
    generator = torch.Generator().manual_seed(4)
    grads = [g / 1000 for g in gradient_set("mixed", [dtype], generator)]  # torch's fp16 norm overflows otherwise
    ours = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    theirs = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    norm = grad_ops.clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm.dtype == torch.float32  # torch returns the gradients' dtype
    torch.testing.assert_close(norm, expected.float(), rtol=rtol, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=1e-6)


@pytest.mark.native
def test_an_fp16_norm_above_65504_does_not_overflow():
    """torch takes fp16 norms in fp16: past 65504 the norm is inf and clipping zeroes every gradient."""
    params = [torch.nn.Parameter(torch.empty(4096, dtype=torch.float16)) for _ in range(3)]
    for p in params:
        p.grad = torch.full_like(p, 1000.0)
    norm = grad_ops.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(norm, torch.tensor((3 * 4096 * 1000.0**2) ** 0.5), rtol=1e-6, atol=0)
    clipped = params[0].grad.float()
    torch.testing.assert_close(clipped, torch.full_like(clipped, 1000.0 / norm.item()), rtol=1e-3, atol=0)


@pytest.mark.native
def test_the_clip_reuses_the_norms_measured_by_the_unscale():
    grads = gradient_set("mixed", DTYPES, torch.Generator().manual_seed(5))
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    measured = grad_ops.unscale_([p.grad for p in params], torch.zeros(()), torch.tensor(0.25))
    assert len(measured) == len(params)
    exact = torch.stack([p.grad.double().square().sum() for p in params]).sum().sqrt()
    # Half of the parameters: the measured sums are picked out; the others would be measured anew.
    total = grad_ops.total_norm_([p.grad for p in params[::2]], measured)
    torch.testing.assert_close(
        total.double(),
        torch.stack([p.grad.double().square().sum() for p in params[::2]]).sum().sqrt(),
        rtol=1e-6,
        atol=0,
    )  # noqa: E501
    norm = grad_ops.clip_grad_norm_(params, 1e9, measured=measured)
    torch.testing.assert_close(norm.double(), exact, rtol=1e-6, atol=0)


def test_grads_the_kernels_do_not_take_go_through_torch():
    generator = torch.Generator().manual_seed(6)
    dense = torch.randn(40, 30, generator=generator)
    odd = [dense.t(), torch.randn(50, generator=generator, dtype=torch.float64), torch.randn(64, generator=generator)]
    expected = [g.clone() for g in odd]
    found_inf = torch.zeros(())
    for g in expected:
        torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, torch.tensor(0.5))
    grads = [g.clone() for g in odd]
    measured = grad_ops.unscale_(grads, torch.zeros(()), torch.tensor(0.5))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert len(measured) == (1 if _ext.status().loaded else 0)  # only the contiguous fp32 one is fused
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in odd]
    for p, g in zip(params, grads):
        p.grad = g
    reference = [torch.nn.Parameter(torch.empty_like(g)) for g in odd]
    for p, g in zip(reference, grads):
        p.grad = g.clone()
    torch.testing.assert_close(grad_ops.clip_grad_norm_(params, 1.0), torch.nn.utils.clip_grad_norm_(reference, 1.0))
    torch.testing.assert_close(
        grad_ops.clip_grad_norm_(params, 1.0, norm_type=1.0),
        torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type=1.0),
    )


def test_clip_grad_norm_with_no_gradients_is_zero_like_torch():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert grad_ops.clip_grad_norm_(params, 1.0).item() == torch.nn.utils.clip_grad_norm_(params, 1.0).item() == 0.0


@pytest.mark.native
@pytest.mark.parametrize(
    "args,message",
    [
        (
            lambda: (
                [torch.ones(3)],
                torch.zeros((), dtype=torch.float64),
                torch.tensor(1.0),
                torch.empty(1, dtype=torch.float64),
            ),
            "found_inf must be a one-element float32",
        ),  # noqa: E501
        (
            lambda: ([torch.ones(3)], torch.zeros(()), torch.tensor([1.0, 2.0]), torch.empty(1, dtype=torch.float64)),
            "inv_scale must be a one-element float32",
        ),  # noqa: E501
        (
            lambda: ([torch.ones(3)], torch.zeros(()), torch.tensor(1.0), torch.empty(2, dtype=torch.float64)),
            "one entry per grad",
        ),  # noqa: E501
        (
            lambda: (
                [torch.ones(3), torch.ones(3, dtype=torch.float64)],
                torch.zeros(()),
                torch.tensor(1.0),
                torch.empty(2, dtype=torch.float64),
            ),
            r"grads\[1\] is Double",
        ),  # noqa: E501
        (
            lambda: ([torch.ones(4, 4).t()], torch.zeros(()), torch.tensor(1.0), torch.empty(1, dtype=torch.float64)),
            r"grads\[0\] is not contiguous",
        ),  # noqa: E501
        (
            lambda: (
                [torch.ones(3).to_sparse()],
                torch.zeros(()),
                torch.tensor(1.0),
                torch.empty(1, dtype=torch.float64),
            ),
            "'SparseCPU' backend",
        ),  # the dispatcher refuses it before the kernel  # noqa: E501
    ],
)
def test_bad_input_names_the_problem_and_changes_nothing(args, message):
    grads, found_inf, inv_scale, sq_norms = args()
    before = [g.clone() for g in grads]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.accel.unscale_grads_(grads, found_inf, inv_scale, sq_norms)
    assert all(torch.equal(a.to_dense(), b.to_dense()) for a, b in zip(grads, before))


@pytest.mark.native
def test_clip_bad_input():
    with pytest.raises(RuntimeError, match="total_norm must be a one-element float32"):
        torch.ops.accel.clip_grads_([torch.ones(3)], torch.tensor([1.0, 2.0]), 1.0)


CAPABILITY_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_grad_unscale import gradient_set, check_parity, inject, DTYPES, INV_SCALES
    assert torch.backends.cpu.get_cpu_capability() == {capability!r}, torch.backends.cpu.get_cpu_capability()
    for kind in ("tiny", "large", "mixed"):
        for inv_scale in INV_SCALES:
            assert check_parity(gradient_set(kind, DTYPES, torch.Generator().manual_seed(9)), inv_scale) == 0.0
        generator = torch.Generator().manual_seed(10)
        grads = gradient_set(kind, DTYPES, generator)
        inject(grads, float("nan"), "last", generator)
        assert check_parity(grads, 0.5) == 1.0
    print("ok")
    """
)


@pytest.mark.native
@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2"])
def test_every_cpu_instruction_set_matches_torch(capability):
    """The kernels torch's ATEN_CPU_CAPABILITY selects (this machine's best one runs in the tests above)."""
    if capability not in _ext.status().build_info.get("cpu_kernels", []):
        pytest.skip(f"this build has no {capability} kernels")
    if capability == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    script = CAPABILITY_CHECK.format(tests=os.path.dirname(__file__), capability=capability)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower())
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("kind", ["tiny", "large", "mixed"])
@pytest.mark.parametrize("inv_scale", INV_SCALES)
def test_cuda_unscale_matches_torch(kind, inv_scale):
    grads = gradient_set(kind, [torch.float32, torch.float16], torch.Generator().manual_seed(11), device="cuda")
    assert check_parity(grads, inv_scale) == 0.0
    generator = torch.Generator().manual_seed(12)
    inject(grads, float("inf"), "middle", generator)
    assert check_parity(grads, inv_scale) == 1.0


@pytest.mark.gpu
@pytest.mark.native_cuda
def test_cuda_bf16_unscale_matches_the_cpu_kernel():
    grads = gradient_set("mixed", DTYPES, torch.Generator().manual_seed(13))
    cpu, cpu_inf, cpu_sq = native_unscale(grads, 0.37)
    cuda, cuda_inf, cuda_sq = native_unscale([g.cuda() for g in grads], 0.37)
    assert all(same_bits(a, b.cpu()) for a, b in zip(cpu, cuda)) and cpu_inf.item() == cuda_inf.item()
    torch.testing.assert_close(cuda_sq.cpu(), cpu_sq, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("kind", ["tiny", "large", "mixed"])
@pytest.mark.parametrize("inv_scale", INV_SCALES)
def test_cuda_unscale_matches_torch_in_every_dtype(kind, inv_scale):
    """fp32, fp16 and bf16 in one list, as a model's gradients can be (bf16 against torch's CPU kernel)."""
    grads = gradient_set(kind, DTYPES, torch.Generator().manual_seed(18), device="cuda")
    assert check_parity(grads, inv_scale) == 0.0


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_cuda_inf_and_nan_set_found_inf_in_every_dtype(dtype, value, where):
    generator = torch.Generator().manual_seed(hash((str(value), where, str(dtype))) % 1000)
    for kind in ("tiny", "large", "mixed"):
        grads = gradient_set(kind, [dtype], generator, device="cuda")
        inject(grads, value, where, generator)
        assert check_parity(grads, 2.0**-10) == 1.0
        assert check_parity(grads, 1.0) == 1.0  # the read-only pass (a clip without loss scaling) sees it too
        assert check_parity(grads, 2.0**-10, found_inf_init=1.0) == 1.0


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_unscale_then_clip_grad_norm_matches_torch(dtype):
    """The fused path of accelerator.clip_grad_norm_ (unscale measuring the norm, then the clip) on GPU gradients,
    against torch's unscale then clip_grad_norm_(foreach=True) (on the CPU for bf16)."""
    generator = torch.Generator().manual_seed(19)
    scaled = [g / 1000 * 2.0**10 for g in gradient_set("mixed", [dtype], generator, device="cuda")]
    ours = [torch.nn.Parameter(torch.empty_like(g)) for g in scaled]
    for p, g in zip(ours, scaled):
        p.grad = g.clone()
    found_inf = torch.zeros((), device="cuda")
    measured = grad_ops.unscale_([p.grad for p in ours], found_inf, torch.tensor(2.0**-10, device="cuda"))
    assert len(measured) == len(ours)  # every gradient went through the kernel
    norm = grad_ops.clip_grad_norm_(ours, 0.5, measured=measured)
    reference_device = "cpu" if dtype == torch.bfloat16 else "cuda"
    expected_grads, expected_inf = torch_unscale([g.to(reference_device) for g in scaled], 2.0**-10)
    theirs = [torch.nn.Parameter(torch.empty_like(g)) for g in expected_grads]
    for p, g in zip(theirs, expected_grads):
        p.grad = g
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=reference_device == "cuda" or None)
    rtol = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}[dtype]
    assert found_inf.item() == expected_inf.item() == 0.0 and norm.dtype == torch.float32 and norm.is_cuda
    torch.testing.assert_close(norm.cpu(), expected.float().cpu(), rtol=rtol, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu(), rtol=rtol, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("norm", [0.5, 3.0, 1e4, float("inf"), float("nan")])
def test_cuda_clip_matches_torch(norm):
    grads = gradient_set(
        "mixed", [torch.float32, torch.float16, torch.bfloat16], torch.Generator().manual_seed(14), device="cuda"
    )
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total_norm = torch.tensor(norm, device="cuda")
    torch.nn.utils.clip_grad._clip_grads_with_norm_(params, 2.0, total_norm)
    actual = [g.clone() for g in grads]
    torch.ops.accel.clip_grads_(actual, total_norm, 2.0)
    assert all(same_bits(a, p.grad) for a, p in zip(actual, params))


@pytest.mark.gpu
@pytest.mark.native_cuda
def test_cuda_opcheck():
    grads = gradient_set("mixed", [torch.float32, torch.float16], torch.Generator().manual_seed(15), device="cuda")
    args = (
        grads,
        torch.zeros((), device="cuda"),
        torch.tensor(0.5, device="cuda"),
        torch.empty(len(grads), dtype=torch.float64, device="cuda"),
    )
    torch.library.opcheck(torch.ops.accel.unscale_grads_.default, args)
    torch.library.opcheck(torch.ops.accel.clip_grads_.default, (grads, torch.tensor(40.0, device="cuda"), 1.0))


def _unscale_synced_gradients(inject_on_rank):
    """Every rank builds the same gradients (one with inf on `inject_on_rank`), all-reduces them as DDP does,
    then unscales: found_inf and the measured sums must agree bit for bit across ranks."""
    import torch.distributed as dist

    from accel.state import PartialState

    state = PartialState()
    generator = torch.Generator().manual_seed(21)
    grads = gradient_set("mixed", [torch.float32], generator)
    if state.process_index == inject_on_rank:
        inject(grads, float("inf"), "middle", torch.Generator().manual_seed(22))
    for grad in grads:
        dist.all_reduce(grad)
    found_inf = torch.zeros(())
    measured = grad_ops.unscale_(grads, found_inf, torch.tensor(2.0**-8))
    sums = [sq for _, sq in measured.sources]
    return found_inf.item(), [s.tolist() for s in sums], [g.sum().item() for g in grads]


@pytest.mark.parametrize("inject_on_rank", [None, 1])
def test_found_inf_and_norms_agree_across_ranks(inject_on_rank):
    from spawn_pool import run_on_ranks

    (inf_0, sums_0, totals_0), (inf_1, sums_1, totals_1) = run_on_ranks(_unscale_synced_gradients, 2, inject_on_rank)
    assert inf_0 == inf_1 == (0.0 if inject_on_rank is None else 1.0)
    if inject_on_rank is None:  # (with an inf the sums hold nan, which compares unequal to itself)
        assert sums_0 == sums_1 and totals_0 == totals_1
