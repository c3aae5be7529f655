"""fp16 loss scaling's unscale + gradient clip, through the public API, side by side with HF Accelerate.

What a user times is `accelerator.clip_grad_norm_(model.parameters(), max_norm)` right after
`accelerator.backward(loss)` under `mixed_precision="fp16"`: it unscales every gradient (loss scaling) and clips
them. Each case is a gradient set and dtype (the parameters' dtype, so the gradients' too):
  - `small`: 1,000 gradients of 1-10 Ki elements (5.6 M elements: many small layers, norms, biases);
  - `large`: 200 gradients of 40,000 elements (8.0 M elements).

Variants, all measured in every round, in a rotating order (interleaved), each round on fresh gradients:
  - public path (one training step each: zero_grad, forward, `accelerator.backward`, then the timed
    `accelerator.clip_grad_norm_`, then `optimizer.step()`):
    - `accel`: `accel.Accelerator(mixed_precision="fp16", cpu=True)`: a GradScaler for the CPU whose unscale
      is accel's fused kernel (the norm measured in the same pass), then the fused clip;
    - `accel_fallback`: the same with accel's kernels turned off (its pure-torch fallback: torch's unscale and
      clip_grad_norm_ under accel's Python);
    - `hf`: HF Accelerate 1.15's `Accelerator(mixed_precision="fp16", cpu=True)` running its loss-scaling code
      as it does on a GPU. HF turns fp16 off on the CPU (no autocast, no scaler: it trains in fp32 there), so the
      benchmark hands it the scaler it would make for a GPU, torch's `GradScaler`, for the CPU device
      (`accelerator.scaler`, `native_amp=True`, before `prepare`): HF's own `backward` (scaled loss),
      `clip_grad_norm_` (`scaler.unscale_` of every optimizer, then `torch.nn.utils.clip_grad_norm_`) and
      `AcceleratedOptimizer.step` run unchanged. torch's scaler refuses to unscale fp16 gradients (HF fails the
      same way on a GPU); for fp16 parameters it runs torch's own kernel on them (`allow_fp16`);
    - `hf_cpu`: HF's `Accelerator(mixed_precision="fp16", cpu=True)` as shipped: no loss scaling, so its
      `clip_grad_norm_` is `torch.nn.utils.clip_grad_norm_` alone (the same call its "bf16" path makes on the
      CPU). Less work than loss scaling needs (nothing to unscale); shown for reference;
  - op level, on a copy of the same gradients as views of one buffer, restored before every round (not timed):
    - `op_accel`: `accel::unscale_grads_` then `accel::clip_grads_` (two passes over the gradients);
    - `op_torch`: what HF's path runs on them: `torch._amp_foreach_non_finite_check_and_unscale_`, then
      `torch.nn.utils.clip_grad_norm_` (unscale read+write, norm read, scale read+write);
    - `limit`: one streaming read+write of the same bytes (torch bitwise-inverts them in place on every thread:
      memory traffic with no arithmetic to speak of); unscale+clip needs two such passes.

On a GPU (`test_unscale_clip_cuda`, skipped without one; issue 25), the same cases in fp32 and fp16 with the model
on the GPU, each timed part between two `torch.cuda.synchronize()` (what the caller waits for, the GPU's work
included):
  - `accel`: `accel.Accelerator(mixed_precision="fp16")`: the fused CUDA kernels;
  - `accel_fallback`: the same with accel's kernels off;
  - `hf`: HF Accelerate 1.15's `Accelerator(mixed_precision="fp16")` as shipped on a GPU (torch's `GradScaler`,
    `torch.nn.utils.clip_grad_norm_`); for fp16 parameters with the scaler that lets torch's kernel unscale them;
  - `op_accel`, `op_torch` (`clip_grad_norm_(foreach=True)`, torch's fastest path: the limit the issue names) and
    `limit` (one streaming read+write) as above, on the GPU. bf16 is left out: torch's CUDA unscale has no bf16, so
    HF cannot run it. Rounds: ACCEL_BENCH_ROUNDS (default 30).

The gradients are fixed (loss = sum_i <w_i, c_i>, so the gradient of w_i is c_i times the loss scale): every
round sees the same values, the unscaled norm (0.24 small, 0.28 large) is above `MAX_NORM`, so the clip always
scales, and no step overflows. Medians over rounds; a ratio is the median of the per-round ratios (both variants
measured in the same round). pytest-benchmark's own column is the length of a whole round (every variant and
its untimed setup); the per-variant times are in each benchmark's `extra_info`.

Run:  .venv/bin/pytest benchmarks/bench_unscale.py --benchmark-only -p no:cacheprovider -s
      (needs `pip install accelerate==1.15.0` for the HF variants; without it they are left out, with a notice).
Report: benchmarks/report/unscale.py OUT_DIR results.json (`make bench-unscale` runs both).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import unittest.mock
from collections.abc import Callable

import pytest
import torch

from accel import _ext, ops
from accel.precision import grads as grad_ops

SCALE = 65536.0  # torch's GradScaler's initial scale
MAX_NORM = 0.1
SETS = {
    "small": lambda generator: torch.randint(1024, 10 * 1024 + 1, (1000,), generator=generator).tolist(),
    "large": lambda generator: [40_000] * 200,
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ROUNDS = {"small": 40, "large": 40}
WARMUP_ROUNDS = 2
needs_native = pytest.mark.skipif(not _ext.status().loaded, reason="native extension not loaded")
CUDA_DTYPES = ("fp32", "fp16")  # torch's CUDA unscale has no bf16: HF cannot run it
CUDA_ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "30"))
needs_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not _ext.native_for("unscale_grads_", "cuda"),
    reason="needs a CUDA device and accel's CUDA kernels",
)


def synchronize(device: torch.device) -> None:
    """Waits for the GPU's queued work (nothing to wait for on the CPU): timed parts include the device's work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gradient_values(set_name: str, dtype: torch.dtype) -> tuple[list[int], torch.Tensor]:
    """The set's sizes and its unscaled gradients (one buffer): ~1e-4, partly fp16 subnormals, as real ones are."""
    generator = torch.Generator().manual_seed(0)
    sizes = SETS[set_name](generator)
    return sizes, (torch.randn(sum(sizes), generator=generator) * 1e-4).to(dtype)


class FixedGradientModel(torch.nn.Module):
    """Parameters of the given sizes whose gradients are fixed: loss = sum_i <w_i, c_i>, d loss / d w_i = c_i."""

    def __init__(self, sizes: list[int], values: torch.Tensor):
        super().__init__()
        zeros = [torch.zeros(n, dtype=values.dtype, device=values.device) for n in sizes]
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(w) for w in zeros)
        self.targets = [c.clone() for c in values.split(sizes)]  # on the values' device

    def forward(self) -> torch.Tensor:
        return torch.stack([(w * c).sum(dtype=torch.float32) for w, c in zip(self.weights, self.targets)]).sum()


class HFScalerAllowingFp16(torch.amp.GradScaler):
    """torch's GradScaler, which refuses to unscale fp16 gradients; this one runs torch's own kernel on them."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


class TrainingStep:
    """A prepared model + SGD; calling it runs one step and returns how long clip_grad_norm_ took.

    `native=False`: accel's clip_grad_norm_ with its kernels turned off (its pure-torch fallback, what
    ACCEL_DISABLE_NATIVE=1 runs), for accel's own accelerators.
    """

    def __init__(self, accelerator, sizes: list[int], values: torch.Tensor, native: bool = True):
        model = FixedGradientModel(sizes, values)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.accelerator = accelerator
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.kernels = contextlib.nullcontext if native else kernels_off
        self.norm: float | None = None  # the last step's, to check that every variant did the same job

    def __call__(self) -> float:
        self.optimizer.zero_grad()
        self.accelerator.backward(self.model())
        device = self.accelerator.device
        with self.kernels():
            synchronize(device)
            start = time.perf_counter()
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            synchronize(device)
            elapsed = time.perf_counter() - start
        self.optimizer.step()
        self.norm = norm.item()
        return elapsed


@contextlib.contextmanager
def kernels_off():
    """accel's gradient ops as without the extension: every call site asks grads.native_on first."""
    with unittest.mock.patch.object(grad_ops, "native_on", lambda device_type: False):
        yield


def hf_accelerator(loss_scaling: bool, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    import accelerate

    if device.type == "cuda":  # HF's own GPU setup: autocast and torch's GradScaler for CUDA
        accelerator = accelerate.Accelerator(mixed_precision="fp16")
        assert accelerator.device.type == "cuda" and accelerator.native_amp and accelerator.scaler is not None
        if dtype == torch.float16:
            accelerator.scaler = HFScalerAllowingFp16("cuda")
        return accelerator

    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None and not accelerator.native_amp, "HF Accelerate now scales losses on the CPU"
    if loss_scaling:  # what HF's __init__ does on a GPU, with torch's scaler for this device
        scaler_class = HFScalerAllowingFp16 if dtype == torch.float16 else torch.amp.GradScaler
        accelerator.scaler, accelerator.native_amp = scaler_class("cpu"), True
    return accelerator


def timed(
    fn: Callable[[], object], setup: Callable[[], object], device: torch.device = torch.device("cpu")
) -> Callable[[], float]:
    def run() -> float:
        setup()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    return run


def op_level_variants(sizes: list[int], values: torch.Tensor) -> dict[str, Callable[[], float]]:
    """The kernels alone, on gradients that are views of one buffer (restored before every run), on the values'
    device (torch's clip with foreach=True on a GPU, its fastest path; its default on the CPU)."""
    device = values.device
    pristine = values * SCALE
    storage = pristine.clone()
    grads = list(storage.split(sizes))
    params = [torch.nn.Parameter(torch.empty_like(grad)) for grad in grads]
    for param, grad in zip(params, grads):
        param.grad = grad
    inv_scale = torch.tensor(1.0 / SCALE, device=device)
    foreach = True if device.type == "cuda" else None

    def op_accel() -> None:
        found_inf = torch.zeros((), device=device)
        sq_norms = torch.empty(len(grads), dtype=torch.float64, device=device)
        ops.unscale_grads_(grads, found_inf, inv_scale, sq_norms)
        ops.clip_grads_(grads, sq_norms.sum().sqrt().float(), MAX_NORM)

    def op_torch() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros((), device=device), inv_scale)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=foreach)

    def limit() -> None:
        storage.view(torch.int32 if storage.element_size() == 4 else torch.int16).bitwise_not_()

    restore = lambda: storage.copy_(pristine)  # noqa: E731
    return {
        name: timed(fn, restore, device)
        for name, fn in (("op_accel", op_accel), ("op_torch", op_torch), ("limit", limit))
    }


def variants(set_name: str, dtype: torch.dtype) -> tuple[dict[str, Callable[[], float]], int, str | None]:
    """Every variant of a case, each a function returning the seconds its timed part took; the gradients' bytes;
    a notice when the HF variants are left out."""
    import accel

    sizes, values = gradient_values(set_name, dtype)
    runs = {
        "accel": TrainingStep(accel.Accelerator(mixed_precision="fp16", cpu=True), sizes, values),
        "accel_fallback": TrainingStep(
            accel.Accelerator(mixed_precision="fp16", cpu=True), sizes, values, native=False
        ),
    }
    try:
        import accelerate  # noqa: F401
    except ImportError:
        notice = "HF Accelerate is not installed (pip install accelerate==1.15.0): HF variants left out"
    else:
        notice = None
        runs["hf"] = TrainingStep(hf_accelerator(True, dtype), sizes, values)
        runs["hf_cpu"] = TrainingStep(hf_accelerator(False, dtype), sizes, values)
    runs.update(op_level_variants(sizes, values))
    return runs, values.numel() * values.element_size(), notice


def interleaved(runs: dict[str, Callable[[], float]], rounds: int, first_round: int = 0) -> dict[str, list[float]]:
    """Every variant once per round, the order rotated by one each round; seconds per variant, per round."""
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(first_round, first_round + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(runs[name]())
    return samples


def summary(samples: dict[str, list[float]], ratios: tuple = ()) -> dict[str, float]:
    """Median seconds per variant, and `X/accel` ratios as medians of per-round ratios (higher: accel faster)."""
    result = {f"{name}_s": statistics.median(times) for name, times in samples.items()}
    for slower, faster in ratios or RATIOS:
        if slower in samples and faster in samples:
            result[f"{slower}/{faster}"] = statistics.median(s / f for s, f in zip(samples[slower], samples[faster]))
    return result


RATIOS = (("hf", "accel"), ("hf_cpu", "accel"), ("accel_fallback", "accel"), ("op_torch", "op_accel"))
CASES = [(s, d) for s in SETS for d in DTYPES]


@needs_native
@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_unscale_clip(benchmark, case):
    set_name, dtype_name = case
    runs, nbytes, notice = variants(set_name, DTYPES[dtype_name])
    interleaved(runs, WARMUP_ROUNDS)  # first-call costs (allocator, threads, lazy inits) out of the samples
    samples: dict[str, list[float]] = {name: [] for name in runs}

    def one_round() -> None:
        for name, times in interleaved(runs, 1, first_round=len(samples["accel"])).items():
            samples[name] += times

    benchmark.group = f"unscale+clip {set_name}-{dtype_name}"
    benchmark.pedantic(one_round, rounds=ROUNDS[set_name], iterations=1)
    norms = [run.norm for run in runs.values() if isinstance(run, TrainingStep)]
    assert max(norms) < 1.01 * min(norms), f"the variants measured different norms: {norms}"
    assert min(norms) > MAX_NORM, "the clip must scale"
    stats = summary(samples)
    benchmark.extra_info.update(set=set_name, dtype=dtype_name, bytes=nbytes, samples=samples, notice=notice, **stats)
    print(
        f"\n{set_name}-{dtype_name}: "
        + ", ".join(f"{k}={v * 1e3:.2f}ms" if k.endswith("_s") else f"{k}={v:.2f}x" for k, v in stats.items())
    )


# --- on a GPU (issue 25) -----------------------------------------------------------------------------------------

CUDA_RATIOS = (("hf", "accel"), ("accel_fallback", "accel"), ("op_torch", "op_accel"), ("op_torch", "accel"))
CUDA_CASES = [(s, d) for s in SETS for d in CUDA_DTYPES]


def fresh_states() -> None:
    """accel's and HF's singletons as in a new process: a GPU case may follow the CPU cases (cpu=True)."""
    from accel.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        import accelerate
    except ImportError:
        return
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def cuda_variants(set_name: str, dtype: torch.dtype) -> tuple[dict[str, Callable[[], float]], int, str | None]:
    """`variants` on the GPU: accel's and HF's Accelerators as each sets itself up there, and the ops."""
    import accel

    fresh_states()
    device = torch.device("cuda", torch.cuda.current_device())
    sizes, values = gradient_values(set_name, dtype)
    values = values.to(device)
    runs = {
        "accel": TrainingStep(accel.Accelerator(mixed_precision="fp16"), sizes, values),
        "accel_fallback": TrainingStep(accel.Accelerator(mixed_precision="fp16"), sizes, values, native=False),
    }
    assert runs["accel"].accelerator.device.type == "cuda"
    try:
        import accelerate  # noqa: F401
    except ImportError:
        notice = "HF Accelerate is not installed (pip install accelerate==1.15.0): HF variants left out"
    else:
        notice = None
        runs["hf"] = TrainingStep(hf_accelerator(True, dtype, device), sizes, values)
    runs.update(op_level_variants(sizes, values))
    return runs, values.numel() * values.element_size(), notice


@needs_cuda_kernels
@pytest.mark.parametrize("case", CUDA_CASES, ids=[f"cuda-{s}-{d}" for s, d in CUDA_CASES])
def test_unscale_clip_cuda(benchmark, case):
    set_name, dtype_name = case
    runs, nbytes, notice = cuda_variants(set_name, DTYPES[dtype_name])
    interleaved(runs, WARMUP_ROUNDS)
    samples: dict[str, list[float]] = {name: [] for name in runs}

    def one_round() -> None:
        for name, times in interleaved(runs, 1, first_round=len(samples["accel"])).items():
            samples[name] += times

    benchmark.group = f"unscale+clip cuda {set_name}-{dtype_name}"
    benchmark.pedantic(one_round, rounds=CUDA_ROUNDS, iterations=1)
    norms = [run.norm for run in runs.values() if isinstance(run, TrainingStep)]
    assert max(norms) < 1.01 * min(norms), f"the variants measured different norms: {norms}"
    assert min(norms) > MAX_NORM, "the clip must scale"
    stats = summary(samples, CUDA_RATIOS)
    benchmark.extra_info.update(
        set=set_name,
        dtype=dtype_name,
        device="cuda",
        gpu=torch.cuda.get_device_name(),
        bytes=nbytes,
        samples=samples,
        notice=notice,
        **stats,
    )
    print(
        f"\ncuda {set_name}-{dtype_name}: "
        + ", ".join(f"{k}={v * 1e3:.3f}ms" if k.endswith("_s") else f"{k}={v:.2f}x" for k, v in stats.items())
    )
