"""transformers' `Trainer`, PEFT LoRA under it and TRL's `SFTTrainer`, each on 2 CPU processes under HF Accelerate
and under accel standing in for it (issue 20, point 2): the same seed gives the same log history (losses, learning
rates, gradient norms, evaluations) and the same final weights, bit for bit, and a `save_steps` checkpoint either
library wrote resumes under the other to the uninterrupted run's weights, bit for bit.

Every job trains 8 optimizer steps of 2 accumulated micro-batches, evaluates every 4 and checkpoints every 4;
`lm` runs in bf16 (CPU autocast). All jobs of one library run in one launch (jobs/trainer_job.py), three launches
in all: accel's full runs; HF's full runs, its resumes from its own checkpoints and from accel's; accel's resumes
from HF's.
"""

import json

import hf_stack
import pytest

TASKS = {"lm": ["--bf16"], "lora": [], "sft": []}
RESUME_STEP = 4
LAUNCH_TIMEOUT_S = 300
# Past the three launches' own deadlines, so that a stuck launch is ended with its ranks first.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)]


def _job(workspace, task, folder, resume=None):
    out = workspace / "trainer" / folder / task
    argv = [
        "--task",
        task,
        "--tokenizer",
        str(workspace / "tokenizer"),
        "--train",
        str(workspace / "train.jsonl"),
        "--validation",
        str(workspace / "validation.jsonl"),
        "--output_dir",
        str(out),
        "--result",
        str(out / "result.json"),
        "--max_steps",
        "8",
        "--save_steps",
        str(RESUME_STEP),
        "--grad_accum",
        "2",
        *TASKS[task],
    ]
    if resume is not None:
        argv += ["--resume_from_checkpoint", str(workspace / "trainer" / resume / task / f"checkpoint-{RESUME_STEP}")]
    return argv


def _launch(library, workspace, name, jobs):
    path = workspace / "trainer" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jobs))
    hf_stack.run_job(library, "trainer_job", [str(path)], workspace, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(workspace):
    """{run name: {task: output folder}} once the three launches are done."""
    _launch("accel", workspace, "accel", [_job(workspace, task, "accel") for task in TASKS])
    _launch(
        "hf",
        workspace,
        "hf",
        [_job(workspace, task, "hf") for task in TASKS]
        + [_job(workspace, task, f"hf_from_{source}", resume=source) for source in ("hf", "accel") for task in TASKS],
    )
    _launch(
        "accel", workspace, "accel_from_hf", [_job(workspace, task, "accel_from_hf", resume="hf") for task in TASKS]
    )
    return {
        name: {task: workspace / "trainer" / name / task for task in TASKS}
        for name in ("hf", "accel", "hf_from_hf", "hf_from_accel", "accel_from_hf")
    }


def _result(folder):
    return json.loads((folder / "result.json").read_text())


def _timeless(entries):
    """Log entries without their wall-clock fields (runtimes, rates)."""
    return [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k} for entry in entries]


def _fused_clip() -> bool:
    """Whether accel's ranks clip with its fused kernel, whose norm differs from torch's in rounding (see
    accel/precision/grads.py): then `grad_norm` may differ in its last bits, and so may the weights after a step
    that clipped. Without it (ACCEL_DISABLE_NATIVE=1) everything is bit for bit."""
    from accel.precision.grads import native_on

    return native_on("cpu")


def _assert_same_log(got, expected, clipped):
    """Bit for bit, except what the fused clip's rounding reaches: `grad_norm`, and everything after a step that
    clipped (`clipped`: whether one did)."""
    got, expected = _timeless(got), _timeless(expected)
    if not _fused_clip():
        assert got == expected
        return
    assert [sorted(entry) for entry in got] == [sorted(entry) for entry in expected]
    for mine, theirs in zip(got, expected):
        for key, value in theirs.items():
            if key == "grad_norm" or clipped:
                assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, mine, theirs)
            else:
                assert mine[key] == value, (key, mine, theirs)


def _assert_same_weights(folder, reference, clipped):
    got, expected = (hf_stack.weights(path / "final.safetensors") for path in (folder, reference))
    if clipped and _fused_clip():
        assert hf_stack.max_abs_diff(got, expected) <= 1e-6
    else:
        assert hf_stack.bitwise_equal(got, expected), hf_stack.max_abs_diff(got, expected)


def _clipped(result) -> bool:
    """Whether any step's gradient norm exceeded TrainingArguments' max_grad_norm (1.0), so that it clipped."""
    return any(entry.get("grad_norm", 0.0) > 1.0 for entry in result["log_history"])


@pytest.mark.parametrize("task", TASKS)
def test_same_log_history_metrics_and_weights_as_hf(runs, task):
    hf, accel = _result(runs["hf"][task]), _result(runs["accel"][task])
    assert (hf["accelerate"], accel["accelerate"]) == ("accelerate.accelerator", "accel.accelerator")
    assert [entry["step"] for entry in hf["log_history"] if "loss" in entry] == list(range(1, 9))
    _assert_same_log(accel["log_history"] + [accel["eval"]], hf["log_history"] + [hf["eval"]], _clipped(hf))
    _assert_same_weights(runs["accel"][task], runs["hf"][task], _clipped(hf))


@pytest.mark.parametrize("task", TASKS)
def test_checkpoints_have_the_same_files(runs, task):
    files = {
        name: sorted(p.name for p in (runs[name][task] / f"checkpoint-{RESUME_STEP}").iterdir())
        for name in ("hf", "accel")
    }
    assert files["accel"] == files["hf"]


@pytest.mark.parametrize("resumed", ["hf_from_accel", "accel_from_hf"])
@pytest.mark.parametrize("task", TASKS)
def test_each_resumes_the_others_checkpoint_as_hf_resumes_its_own(runs, task, resumed):
    """A checkpoint of either library, resumed by the other, logs what HF logs resuming its own checkpoint (the
    summary's `train_loss` and TRL's `num_tokens` count only the resumed part, in HF too) and ends at the
    uninterrupted run's weights."""
    reference, after_resume = _result(runs["hf_from_hf"][task]), _result(runs[resumed][task])
    assert after_resume["global_step"] == 8
    served_by = "accel.accelerator" if resumed.startswith("accel") else "accelerate.accelerator"
    assert after_resume["accelerate"] == served_by
    uninterrupted = _result(runs["hf"][task])
    clipped = _clipped(uninterrupted)
    _assert_same_log(
        after_resume["log_history"] + [after_resume["eval"]], reference["log_history"] + [reference["eval"]], clipped
    )
    _assert_same_log(_steps(after_resume), _steps(uninterrupted), clipped)
    _assert_same_weights(runs[resumed][task], runs["hf"][task], clipped)


def _steps(result):
    """The log entries of the training steps (loss, grad_norm, learning_rate, ...), less TRL's `num_tokens`, which
    counts from the resume on (in HF too)."""
    return [{k: v for k, v in entry.items() if k != "num_tokens"} for entry in result["log_history"] if "loss" in entry]
