"""fp16 unscale + gradient clip: accel's fused kernels against what HF Accelerate runs, and the memory limit.

Each group is one gradient set and dtype:
  - `small`: 5,000 tensors of 1-10 Ki elements (a model with many small layers, e.g. norms and biases);
  - `large`: ~100 M elements in 200 tensors.
Benchmarks in a group:
  - `hf_unscale_clip`: torch's `GradScaler.unscale_` then `torch.nn.utils.clip_grad_norm_` (HF's
    `accelerator.clip_grad_norm_` under fp16): unscale (read+write), norm (read), scale (read+write);
  - `accel_unscale_clip`: `FusedGradScaler.unscale_` then `accel.precision.grads.clip_grad_norm_`: unscale with
    the norm measured in the same pass (read+write), then the fused scale (read+write);
  - `hf_unscale` / `accel_unscale`: the unscale alone (what every fp16 optimizer step runs);
  - `limit`: one streaming read+write of the same bytes (the gradients are views of one buffer, which torch
    bitwise-inverts in place on every thread: memory traffic with no arithmetic to speak of); an unscale is one
    such pass, unscale+clip at best two.
Gradients are restored before every round (not timed) so every round sees the same values; the unscaled norm
(0.6 for the small sets, 1.2 for the large) is above MAX_NORM, so the clip always scales.

Run: .venv/bin/pytest benchmarks/bench_unscale.py --benchmark-only -p no:cacheprovider
(`make bench-unscale` also writes docs/benchmarks/unscale.md and its plot.)
"""

from __future__ import annotations

import pytest
import torch

from accel import _ext
from accel.precision import grads as grad_ops
from accel.precision.scaler import FusedGradScaler

SCALE = 65536.0
MAX_NORM = 0.1
SETS = {
    "small": lambda generator: torch.randint(1024, 10 * 1024 + 1, (5000,), generator=generator).tolist(),
    "large": lambda generator: [500_000] * 200,
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ROUNDS = {"small": 25, "large": 15}
needs_native = pytest.mark.skipif(not _ext.status().loaded, reason="native extension not loaded")


class GradientSet:
    """Parameters whose gradients are views of one buffer (so `limit` can stream over exactly their bytes), and a
    pristine copy of the scaled gradients to restore before every round."""

    def __init__(self, set_name: str, dtype: torch.dtype):
        generator = torch.Generator().manual_seed(0)
        sizes = SETS[set_name](generator)
        # Scaled gradients as fp16 training has them: small values times 2^16, which fit every dtype (fp16 tops
        # out at 65504); unscaled, they are ~1e-4, partly fp16 subnormals, as real gradients are.
        self.pristine = (torch.randn(sum(sizes), generator=generator) * 8).to(dtype)
        self.storage = self.pristine.clone()
        self.params = [torch.nn.Parameter(torch.empty(size, dtype=dtype)) for size in sizes]
        for param, grad in zip(self.params, self.storage.split(sizes)):
            param.grad = grad
        self.optimizer = torch.optim.SGD(self.params, lr=0.1)
        self.nbytes = self.storage.numel() * self.storage.element_size()

    def restore(self) -> None:
        self.storage.copy_(self.pristine)

    def stream(self) -> None:
        """One read+write pass over the gradients' bytes with next to no arithmetic: the limit."""
        self.storage.view(torch.int32 if self.storage.element_size() == 4 else torch.int16).bitwise_not_()


def unscale(scaler, grads: GradientSet) -> None:
    """What `scaler.unscale_(optimizer)` runs, minus its bookkeeping, with fp16 gradients allowed for both
    scalers (torch's refuses them in unscale_; its kernel handles them)."""
    inv_scale, found_inf = torch.tensor(1.0 / SCALE), torch.zeros(())
    scaler._unscale_grads_(grads.optimizer, inv_scale, found_inf, True)


_current: dict[tuple[str, str], GradientSet] = {}


@pytest.fixture(params=[(s, d) for s in SETS for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def gradients(request) -> tuple[str, GradientSet]:
    key = request.param
    if key not in _current:
        _current.clear()  # one set in memory at a time (the large fp32 one is 800 MB with its copy)
        _current[key] = GradientSet(key[0], DTYPES[key[1]])
    return f"{key[0]}-{key[1]}", _current[key]


def run(benchmark, gradients, fn):
    name, grads = gradients
    benchmark.group = f"unscale {name}"
    benchmark.extra_info["bytes"] = grads.nbytes
    benchmark.pedantic(fn, setup=grads.restore, rounds=ROUNDS[name.split("-")[0]], warmup_rounds=1)


def test_hf_unscale_clip(benchmark, gradients):
    grads, scaler = gradients[1], torch.amp.GradScaler("cpu")

    def unscale_and_clip():
        unscale(scaler, grads)
        torch.nn.utils.clip_grad_norm_(grads.params, MAX_NORM)

    run(benchmark, gradients, unscale_and_clip)


def test_hf_unscale(benchmark, gradients):
    grads, scaler = gradients[1], torch.amp.GradScaler("cpu")
    run(benchmark, gradients, lambda: unscale(scaler, grads))


@needs_native
def test_accel_unscale_clip(benchmark, gradients):
    grads, scaler = gradients[1], FusedGradScaler("cpu")

    def unscale_and_clip():
        with scaler.measuring() as measured:
            unscale(scaler, grads)
        grad_ops.clip_grad_norm_(grads.params, MAX_NORM, measured=measured)

    run(benchmark, gradients, unscale_and_clip)


@needs_native
def test_accel_unscale(benchmark, gradients):
    grads, scaler = gradients[1], FusedGradScaler("cpu")
    run(benchmark, gradients, lambda: unscale(scaler, grads))


def test_limit(benchmark, gradients):
    run(benchmark, gradients, gradients[1].stream)
