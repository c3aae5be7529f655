"""fp16 mixed precision, on the CPU for real: autocast forward, torch's GradScaler, skipped steps."""

import pytest
import torch
from spawn_pool import run_on_ranks
from test_accelerator import global_batches, make_model

from accel.accelerator import Accelerator
from accel.accelerator_config import GradScalerKwargs
from accel.state import AcceleratorState, GradientState


def _train(mixed_precision, steps=30, overflow_at=None, scaler_kwargs=None):
    """(losses, skipped flags, scales after each step, learning rates, final parameters)."""
    AcceleratorState._reset_state()  # a new precision in the same process (the process group is kept)
    GradientState._reset_state()
    handlers = [GradScalerKwargs(**scaler_kwargs)] if scaler_kwargs else None
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    inputs, targets = global_batches(count=4)
    losses, skipped, scales, rates = [], [], [], []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs[step % 4]), targets[step % 4])
        losses.append(loss.item())
        if step == overflow_at:
            loss = loss * float("inf")
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        scales.append(accelerator.scaler.get_scale() if accelerator.scaler is not None else None)
        rates.append(scheduler.get_last_lr()[0])
    parameters = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return losses, skipped, scales, rates, parameters


def test_fp16_follows_the_fp32_loss_curve_on_the_cpu():
    fp32, _, _, _, _ = _train("no")
    fp16, skipped, _, _, _ = _train("fp16", scaler_kwargs=dict(init_scale=1024.0))  # no overflow to skip
    assert not any(skipped)
    torch.testing.assert_close(torch.tensor(fp16), torch.tensor(fp32), rtol=0.05, atol=1e-3)
    assert sum(fp16[-4:]) < 0.8 * sum(fp16[:4])  # it trained (4 batches in turn)


def test_the_fp16_forward_runs_under_autocast_and_returns_fp32():
    accelerator = Accelerator(mixed_precision="fp16")
    model = accelerator.prepare(make_model())
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    output = model(global_batches(count=1)[0][0])
    assert seen == [torch.float16] and output.dtype == torch.float32
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() == 65536.0


def test_an_overflow_skips_exactly_that_step_then_the_scale_backs_off_and_regrows():
    kwargs = dict(init_scale=1024.0, growth_interval=3)
    losses, skipped, scales, rates, _ = _train("fp16", steps=10, overflow_at=5, scaler_kwargs=kwargs)
    assert skipped == [False] * 5 + [True] + [False] * 4
    # grows after every 3 good steps, halves on the overflow (which also restarts the count)
    assert scales == [1024, 1024, 2048, 2048, 2048, 1024, 1024, 1024, 2048, 2048]
    assert rates[5] == rates[4] and rates[6] < rates[5]  # the scheduler did not step with the skipped step


def test_the_skipped_step_leaves_the_parameters_as_they_were():
    *_, before = _train("fp16", steps=5, scaler_kwargs=dict(init_scale=1024.0))
    *_, after = _train("fp16", steps=6, overflow_at=5, scaler_kwargs=dict(init_scale=1024.0))
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_clip_grad_norm_unscales_first():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256.0)])
    model = accelerator.prepare(make_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, targets = global_batches(count=1)
    accelerator.backward(torch.nn.functional.mse_loss(model(inputs[0]), targets[0]))
    scaled = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e9)
    torch.testing.assert_close(norm, scaled / 256.0, rtol=1e-5, atol=0)
    optimizer.step()  # the scaler remembers the unscale: no second division
    assert not accelerator.optimizer_step_was_skipped


def _fp16_on_ranks(overflow_rank):
    from accel.state import PartialState

    overflow_at = 3 if PartialState().process_index == overflow_rank else None
    _, skipped, scales, _, parameters = _train(
        "fp16", steps=6, overflow_at=overflow_at, scaler_kwargs=dict(init_scale=1024.0)
    )
    return skipped, scales, parameters


@pytest.mark.parametrize("world_size", [2])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(world_size):
    results = run_on_ranks(_fp16_on_ranks, world_size, 1, timeout=120)
    (skipped_0, scales_0, params_0), (skipped_1, scales_1, params_1) = results
    assert skipped_0 == skipped_1 == [False, False, False, True, False, False]
    assert scales_0 == scales_1
    assert all(torch.equal(a, b) for a, b in zip(params_0, params_1))  # still in lockstep


def test_two_optimizers_are_unscaled_once_and_the_scale_updates_once():
    AcceleratorState._reset_state()
    kwargs = GradScalerKwargs(init_scale=1024.0, growth_interval=1)  # every good step doubles the scale
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[kwargs])
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    first, second = accelerator.prepare(torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0))
    for step in range(2):
        accelerator.backward((a * 5).sum() + (b * 3).sum())
        accelerator.clip_grad_norm_([a, b], max_norm=1e9)  # unscales both optimizers
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        assert accelerator.scaler.get_scale() == 1024.0 * 2 ** (step + 1)  # one update per iteration
    assert a.tolist() == [-10.0, -10.0] and b.tolist() == [-6.0, -6.0]  # divided by the scale once


def test_an_unscaled_optimizer_that_does_not_step_delays_the_update_to_the_next_backward():
    AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    first, second = accelerator.prepare(torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0))
    accelerator.backward((a * 5).sum() + (b * 3).sum())
    accelerator.unscale_gradients()
    first.step()  # `second` never steps in this iteration
    first.zero_grad()
    second.zero_grad()
    accelerator.backward((a * 5).sum())  # updates first, so the next step is allowed
    first.step()
    assert a.tolist() == [-10.0, -10.0] and b.tolist() == [0.0, 0.0]


def test_bf16_follows_the_fp32_loss_curve_without_a_scaler():
    fp32, *_ = _train("no")
    bf16, skipped, scales, _, _ = _train("bf16")
    assert scales == [None] * len(bf16) and not any(skipped)
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=0.05, atol=2e-3)


def _train_low_precision_parameters(param_dtype, steps=30, clip=None):
    """fp16 mixed precision on a model whose parameters (hence gradients) are themselves fp16 or bf16."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = make_model().to(param_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets = global_batches(count=4)
    losses, norms = [], []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs[step % 4].to(param_dtype)), targets[step % 4])
        accelerator.backward(loss)
        if clip is not None:
            norms.append(accelerator.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == param_dtype and p.grad is None for p in model.parameters())
    return losses, norms


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_fp16_trains_a_model_whose_parameters_are_fp16_or_bf16(param_dtype):
    """torch's GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients"); accel unscales them."""
    losses, norms = _train_low_precision_parameters(param_dtype, clip=1.0)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4])
    assert all(n > 0 and n == n for n in norms)


def _clipped_run(mixed_precision):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = accelerator.prepare(make_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    inputs, targets = global_batches(count=4)
    losses, norms = [], []
    for step in range(20):
        loss = torch.nn.functional.mse_loss(model(inputs[step % 4]), targets[step % 4])
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.05).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def test_clipped_fp16_training_follows_clipped_fp32_training():
    fp32_losses, fp32_norms = _clipped_run("no")
    fp16_losses, fp16_norms = _clipped_run("fp16")
    assert max(fp32_norms) > 0.05  # the clip is active
    torch.testing.assert_close(torch.tensor(fp16_norms), torch.tensor(fp32_norms), rtol=0.05, atol=1e-3)
    torch.testing.assert_close(torch.tensor(fp16_losses), torch.tensor(fp32_losses), rtol=0.05, atol=1e-3)


def test_the_example_trains_in_fp16_under_accel_launch(tmp_path):
    """`accel launch --mixed_precision fp16 --cpu --num_processes 2 examples/train.py`: autocast, scaler, clip."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "train.py"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel",
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "--mixed_precision",
            "fp16",
            str(example),
            "--epochs",
            "2",
            "--samples",
            "1024",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mixed precision fp16" in result.stdout
    assert "first layer computes in ['torch.float16']" in result.stdout
    assert "loss scale 65536" in result.stdout
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in result.stdout.splitlines() if "eval mse" in line]
    assert len(losses) == 2 and losses[1] < losses[0]


def _scaled_step(param_dtype, max_norm):
    """One fp16 step on many small parameters of `param_dtype`: (their scaled gradients, the gradients and norm
    after accelerator.clip_grad_norm_, the loss scale)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    generator = torch.Generator().manual_seed(23)
    sizes = torch.randint(1, 3000, (150,), generator=generator).tolist()
    targets = [(torch.randn(n, generator=generator) * 1e-3).to(param_dtype) for n in sizes]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=param_dtype)) for n in sizes]
    optimizer = accelerator.prepare(torch.optim.SGD(params, lr=0.1))
    accelerator.backward(torch.stack([(p * t).sum(dtype=torch.float32) for p, t in zip(params, targets)]).sum())
    scaled = [p.grad.clone() for p in params]
    norm = accelerator.clip_grad_norm_(params, max_norm)
    clipped = [p.grad.clone() for p in params]
    optimizer.step()  # the scaler remembers the unscale (no second division) and the step is not skipped
    assert not accelerator.optimizer_step_was_skipped
    assert all(torch.equal(p.detach(), torch.zeros_like(g).add_(g, alpha=-0.1)) for p, g in zip(params, clipped))
    return scaled, clipped, norm, accelerator.scaler.get_scale()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [1e9, 0.01])
def test_clip_grad_norm_after_backward_matches_torchs_unscale_and_clip(param_dtype, max_norm):
    """The public path (fused unscale measuring the norm, fused clip) against what HF Accelerate runs: torch's
    unscale, then torch.nn.utils.clip_grad_norm_. Unscaled gradients are bit-identical; clipped ones and the norm
    agree to two units in the last place (torch rounds fp16/bf16 norms and clip coefficients to the gradients'
    dtype, accel keeps them in fp32)."""
    scaled, clipped, norm, scale = _scaled_step(param_dtype, max_norm)
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in scaled]
    for param, grad in zip(reference, scaled):
        param.grad = grad.clone()
    torch._amp_foreach_non_finite_check_and_unscale_(
        [p.grad for p in reference], torch.zeros(()), torch.tensor(1.0 / scale)
    )
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    rtol = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}[param_dtype]
    torch.testing.assert_close(norm.float(), expected_norm.float(), rtol=rtol, atol=0)  # fp32 when fused
    assert max_norm == 1e9 or norm.item() > 2 * max_norm  # the second case clips
    for ours, theirs in zip(clipped, reference):
        if max_norm == 1e9:
            assert torch.equal(ours, theirs.grad)
        else:
            atol = 2**-24 if param_dtype == torch.float16 else 0  # one step of fp16's subnormals
            torch.testing.assert_close(ours, theirs.grad, rtol=rtol, atol=atol)


# --- one GPU ------------------------------------------------------------------------------------------------------


def _reset_hf():
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def _fresh(library, mixed_precision):
    """A new Accelerator of accel or of HF Accelerate 1.15 (`library`), its singletons reset first."""
    if library == "accel":
        AcceleratorState._reset_state()
        GradientState._reset_state()
        return Accelerator(mixed_precision=mixed_precision)
    _reset_hf()
    import accelerate

    return accelerate.Accelerator(mixed_precision=mixed_precision)


def _gpu_steps(library, mixed_precision, overflow_at=None, steps=8, max_norm=1e9):
    """Training steps of make_model on the GPU through `library`'s Accelerator: what each step saw and did."""
    accelerator = _fresh(library, mixed_precision)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert accelerator.device.type == "cuda" and all(p.is_cuda for p in model.parameters())
    inputs, targets = (t.to(accelerator.device) for t in global_batches(count=4))
    seen, record = [], {"losses": [], "norms": [], "skipped": [], "scales": []}
    accelerator.unwrap_model(model)[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs[step % 4]), targets[step % 4])
        record["losses"].append(loss.item())
        if step == overflow_at:
            loss = loss * float("inf")
        accelerator.backward(loss)
        record["norms"].append(accelerator.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        record["skipped"].append(accelerator.optimizer_step_was_skipped)
        record["scales"].append(accelerator.scaler.get_scale() if accelerator.scaler is not None else None)
    record["computed_in"] = set(seen)
    record["parameters"] = [p.detach().cpu() for p in accelerator.unwrap_model(model).parameters()]
    if library != "accel":
        _reset_hf()  # as a new process has them
    return record


@pytest.mark.gpu
@pytest.mark.parametrize("mixed_precision,overflow_at", [("bf16", None), ("fp16", None), ("fp16", 3)])
def test_a_gpu_training_step_matches_hf_accelerate(mixed_precision, overflow_at):
    """Steps on one GPU through Accelerator(mixed_precision=...) give what HF Accelerate 1.15's give: the same
    losses and parameters bit for bit (max_norm is not reached: unscaled gradients are bit-identical, so every
    update is), the same skipped step and loss scales, norms to fp32 rounding; fp16 goes through the fused
    CUDA kernels when the build has them."""
    from unittest import mock

    from accel import _ext, ops

    with mock.patch.object(ops, "unscale_grads_", wraps=ops.unscale_grads_) as fused:
        ours = _gpu_steps("accel", mixed_precision, overflow_at)
    theirs = _gpu_steps("hf", mixed_precision, overflow_at)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    assert ours["computed_in"] == theirs["computed_in"] == {dtype}
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=0, atol=0)
    assert ours["skipped"] == theirs["skipped"] == [step == overflow_at for step in range(8)]
    assert ours["scales"] == theirs["scales"]
    assert (ours["scales"][0] is not None) == (mixed_precision == "fp16")
    torch.testing.assert_close(
        torch.tensor(ours["norms"]), torch.tensor(theirs["norms"]), rtol=1e-5, atol=0, equal_nan=True
    )
    for a, b in zip(ours["parameters"], theirs["parameters"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sum(ours["losses"][-2:]) < sum(ours["losses"][:2])  # it trained
    if mixed_precision == "fp16" and _ext.status().cuda_kernels:
        assert fused.call_count >= 8 and all(call.args[1].is_cuda for call in fused.call_args_list)


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_fp16_on_a_gpu_trains_fp16_and_bf16_parameters(param_dtype):
    """torch's GradScaler refuses fp16 gradients on a GPU, and its CUDA unscale has no bf16 (HF fails on both);
    accel unscales and clips them."""
    accelerator = _fresh("accel", "fp16")
    model = make_model().to(param_dtype)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, targets = (t.to(accelerator.device) for t in global_batches(count=4))
    losses, norms = [], []
    for step in range(30):
        loss = torch.nn.functional.mse_loss(model(inputs[step % 4].to(param_dtype)), targets[step % 4])
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(p.is_cuda and p.dtype == param_dtype for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(losses))) and all(0 < n < float("inf") for n in norms)
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4])


# --- the seams ---------------------------------------------------------------------------------------------------


def test_policies_and_strategies_fill_their_base_classes():
    from accel.precision import PRECISIONS, BF16Precision, FP16Precision
    from accel.precision.base import Precision
    from accel.strategies import STRATEGIES, DDPStrategy, SingleDeviceStrategy, Strategy

    assert all(issubclass(policy, Precision) for policy in PRECISIONS.values())
    assert all(issubclass(strategy, Strategy) for strategy in STRATEGIES.values())
    assert not issubclass(FP16Precision, BF16Precision) and not issubclass(DDPStrategy, SingleDeviceStrategy)
    with pytest.raises(TypeError, match="abstract"):
        Precision(torch.device("cpu"))
    with pytest.raises(TypeError, match="abstract"):
        Strategy(None, None)


def test_torchs_private_scaler_fields_are_read_in_one_module():
    from pathlib import Path

    import accel
    from accel.precision import scaler

    readers = [
        path for path in Path(accel.__file__).parent.rglob("*.py") if "._per_optimizer_states" in path.read_text()
    ]
    assert readers == [Path(scaler.__file__)]
