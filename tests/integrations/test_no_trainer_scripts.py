"""Training loops written on the Accelerate API itself, as transformers' `run_clm_no_trainer.py` and
`run_glue_no_trainer.py` write them (jobs/clm_no_trainer.py, jobs/glue_no_trainer.py), on 2 CPU processes under
HF Accelerate and under accel standing in for it (issue 20, point 2): with `--checkpointing_steps`,
`--with_tracking` (TensorBoard) and `--resume_from_checkpoint`, the same seed gives the same per-step losses,
evaluation (perplexity; accuracy from `gather_for_metrics`), TensorBoard scalars and final weights, bit for bit;
and each library resumes the other's `save_state` folder exactly as HF resumes its own.

clm: 2 epochs, gradient accumulation 2, a checkpoint every 3 optimizer steps, resumed from `step_3` (mid-epoch:
`skip_first_batches`). glue: 3 epochs, a checkpoint per epoch, resumed from `epoch_0`. HF does not resume either
to its uninterrupted run (the shuffling sampler's generator is not in the checkpoint unless
`use_seedable_sampler`), so the reference for a resume is HF resuming its own checkpoint.
"""

import json

import hf_stack
import pytest

SCRIPTS = {
    "clm": (
        [
            "--train_file",
            "train.txt",
            "--validation_file",
            "validation.txt",
            "--gradient_accumulation_steps",
            "2",
            "--checkpointing_steps",
            "3",
        ],
        "step_3",
    ),
    "glue": (
        ["--train_file", "train.csv", "--validation_file", "validation.csv", "--checkpointing_steps", "epoch"],
        "epoch_0",
    ),
}
# In this order: a resumed run's source ran before it.
RUNS = ("hf", "accel", "hf_from_hf", "hf_from_accel", "accel_from_hf")
# Past the jobs' own deadlines (hf_stack.JOB_TIMEOUT_S each), so that a stuck job is ended with its ranks first.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(len(RUNS) * hf_stack.JOB_TIMEOUT_S + 60)]


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def runs(request, workspace):
    """{run name: its output folder} once the script ran each way: "hf" and "accel" from scratch, "x_from_y"
    under x from y's checkpoint."""
    script, folders = request.param, {}
    flags, checkpoint = SCRIPTS[script]
    for name in RUNS:
        library, _, source = name.partition("_from_")
        folders[name] = workspace / script / name
        argv = [*flags, "--tokenizer_name", "tokenizer", "--output_dir", str(folders[name]), "--with_tracking"]
        if source:
            argv += ["--resume_from_checkpoint", str(folders[source] / checkpoint)]
        hf_stack.run_job(library, f"{script}_no_trainer", argv, workspace)
    return folders


def _results(folder):
    return json.loads((folder / "results.json").read_text())


def _scalars(folder):
    """{tag: [(step, value), ...]} of the TensorBoard events the tracker wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = [path.parent for path in folder.glob("*_no_trainer/events.out.tfevents.*")]
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def _assert_same_weights(folder, reference):
    got, expected = (hf_stack.weights(path / "model.safetensors") for path in (folder, reference))
    assert hf_stack.bitwise_equal(got, expected), hf_stack.max_abs_diff(got, expected)


def test_same_losses_metrics_and_weights_as_hf(runs):
    hf, accel = _results(runs["hf"]), _results(runs["accel"])
    assert (hf["accelerate"], accel["accelerate"]) == ("accelerate.accelerator", "accel.accelerator")
    assert len(hf["step_losses"]) >= 10 and len(hf["evaluations"]) >= 2
    assert accel["step_losses"] == hf["step_losses"]
    assert accel["evaluations"] == hf["evaluations"]
    _assert_same_weights(runs["accel"], runs["hf"])


def test_same_checkpoint_folders_as_hf(runs):
    folders = {name: sorted(path.name for path in runs[name].iterdir() if path.is_dir()) for name in ("hf", "accel")}
    assert folders["accel"] == folders["hf"]
    assert any(name.startswith(("step_", "epoch_")) for name in folders["hf"])


def test_same_tracked_scalars_as_hf(runs):
    hf = _scalars(runs["hf"])
    assert hf and _scalars(runs["accel"]) == hf


@pytest.mark.parametrize("resumed", ["hf_from_accel", "accel_from_hf"])
def test_each_resumes_the_others_checkpoint_as_hf_resumes_its_own(runs, resumed):
    reference, after_resume = _results(runs["hf_from_hf"]), _results(runs[resumed])
    assert after_resume["step_losses"] == reference["step_losses"]
    assert after_resume["evaluations"] == reference["evaluations"]
    assert min(map(int, reference["step_losses"])) > 1  # it did resume
    _assert_same_weights(runs[resumed], runs["hf_from_hf"])
