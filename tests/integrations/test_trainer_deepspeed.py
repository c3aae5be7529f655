"""transformers' `Trainer` with `deepspeed=` on 2 CPU processes under accel standing in for HF Accelerate (issue 22):
DeepSpeed's engine trains it, with the losses of the same Trainer run without DeepSpeed (DDP). HF Accelerate cannot
run this job on CPU processes (it drops the plugin under --cpu, or fails DeepSpeed's batch-size check)."""

import importlib.util
import json

import hf_stack
import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(2 * hf_stack.JOB_TIMEOUT_S + 60),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"),
]


def _run(workspace, stage):
    name = f"zero{stage}" if stage is not None else "ddp"
    result = workspace / f"trainer_deepspeed_{name}.json"
    args = ["--result", str(result), "--output_dir", str(workspace / f"trainer_deepspeed_{name}")]
    hf_stack.run_job(
        "accel", "trainer_deepspeed", args + (["--stage", str(stage)] if stage is not None else []), workspace
    )
    return json.loads(result.read_text())


def test_trainer_with_deepspeed_zero2_trains_as_without_it(workspace):
    zero, ddp = _run(workspace, 2), _run(workspace, None)
    assert (zero["distributed_type"], ddp["distributed_type"]) == (
        "DistributedType.DEEPSPEED",
        "DistributedType.MULTI_CPU",
    )
    assert len(zero["losses"]) == 6
    assert zero["losses"] == pytest.approx(ddp["losses"], rel=1e-4)
