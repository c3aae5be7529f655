"""`accel launch --max_restarts`: a worker group restarted by torch elastic after a process died starts afresh (its
own store keys: accel.wire.process_group._this_attempts_store) and resumes from the newest checkpoint when the
script asks (`load_state()` with automatic naming), ending with the weights of a run that never failed."""

import re

import pytest
from test_launch import accel, free_port, isolated_env, write

TRAINING = """
    import os, sys, time
    import torch
    from accel import Accelerator
    from accel.utils import ProjectConfiguration

    class Progress:
        def __init__(self):
            self.epoch = 0
        def state_dict(self):
            return {"epoch": self.epoch}
        def load_state_dict(self, state):
            self.epoch = state["epoch"]

    project, die = sys.argv[1], sys.argv[2] == "die"
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 1 and os.environ["RANK"] == "1":
        time.sleep(2)  # starts late: its peer must not find the address rank 1 had in the failed attempt
    configuration = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=configuration)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if os.path.isdir(os.path.join(project, "checkpoints")):
        accelerator.load_state()  # the newest checkpoint
        os.write(1, f"rank {accelerator.process_index} attempt {attempt} resumes at epoch {progress.epoch}\\n".encode())
    while progress.epoch < 4:
        generator = torch.Generator().manual_seed(10 * progress.epoch + accelerator.process_index)
        inputs = torch.randn(8, 4, generator=generator)
        accelerator.backward(model(inputs).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        progress.epoch += 1
        accelerator.save_state()
        if die and attempt == 0 and progress.epoch == 2 and accelerator.process_index == 1:
            os._exit(7)  # killed after its second checkpoint; its peer fails at the next collective
    if accelerator.is_main_process:
        weights = accelerator.get_state_dict(model)
        os.write(1, f"weights {[round(v, 8) for t in weights.values() for v in t.flatten().tolist()]}\\n".encode())
    accelerator.end_training()
"""


def run(tmp_path, name, mode, *flags):
    script = write(tmp_path / "train.py", TRAINING)
    project = tmp_path / name
    env = isolated_env(tmp_path, ACCEL_PROCESS_GROUP_TIMEOUT="60")  # a wait that cannot end fails within a minute
    argv = ["launch", "--cpu", "--num_processes", "2", *flags, str(script), str(project), mode]
    result = accel(tmp_path, *argv, timeout=240, env=env)
    weights = re.findall(r"^weights (.*)$", result.stdout, re.MULTILINE)
    return result, weights


# Both rendezvous `accel launch` uses on one machine: c10d on a port it picks (torch gives each attempt a store:
# accel.cli.launch.restart_env), and torch's static rendezvous at a given port (one agent's store, which
# accel.wire.process_group divides by attempt).
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_a_restarted_worker_group_resumes_from_the_newest_checkpoint_and_ends_as_an_unbroken_run(tmp_path, rendezvous):
    port = ["--main_process_port", str(free_port())] if rendezvous == "static" else []
    restarted, weights = run(tmp_path, "restarted", "die", *port, "--max_restarts", "1", "--monitor_interval", "0.5")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    resumed = sorted(re.findall(r"^rank \d attempt 1 resumes at epoch (\d)$", restarted.stdout, re.MULTILINE))
    assert resumed == ["2", "2"], restarted.stdout
    unbroken, reference = run(tmp_path, "unbroken", "live")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    assert weights == reference and len(weights) == 1


def test_without_restarts_a_dead_process_fails_the_job(tmp_path):
    result, weights = run(tmp_path, "failed", "die")
    assert result.returncode != 0 and not weights
