"""An Accelerator inside Ray Train's TorchTrainer (issue 24, point 4): examples/ray_train.py's loop on 2 CPU workers.

jobs/ray_train_job.py runs it on a local Ray instance in its own process: Accelerator() adopts the group Ray made
(shared memory natively, gloo without the extension), the prepared dataloader shards the data per worker, and the
`save_state` folder handed to `ray.train.report` becomes the run's checkpoint, whose weights fit the data.

Loopback only: Ray is pinned to 127.0.0.1 (its node address, and so TorchTrainer's MASTER_ADDR, which is worker 0's
node address) and gloo to `lo`; the job checks every address Ray reports before training and skips (saying which
address) if one is not loopback, and each worker checks MASTER_ADDR. Usage statistics and token files are off.

Nothing is left behind: every process of the run carries a marker in its environment; any still alive once the job
has shut Ray down (raylet, gcs_server, workers) is killed by pid and fails the test.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from accel import _ext
from accel.test_utils.ray_loopback import LOOPBACK_ENV

pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'accel[ray]')")

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).parent / "jobs" / "ray_train_job.py"
JOB_TIMEOUT_S = 240
MARKER = "ACCEL_RAY_TEST_RUN"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(JOB_TIMEOUT_S + 60)]


def _marked(run: str) -> list[psutil.Process]:
    """The live processes whose environment carries this run's marker (Ray's daemons and workers inherit it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(MARKER) == run:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _leftovers(run: str, grace_s: float = 15.0) -> list[str]:
    """Processes of the run still alive `grace_s` after the job ended (Ray's daemons exit just after shutdown), killed
    by pid; their names."""
    deadline = time.monotonic() + grace_s
    while _marked(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = []
    for process in _marked(run):
        try:
            names.append(f"{process.pid} {process.name()}")
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(_marked(run), timeout=10)
    return names


def _run_job(folder: str, run: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **LOOPBACK_ENV, **{MARKER: run})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "examples"), env.get("PYTHONPATH")]))
    job = subprocess.Popen(
        [sys.executable, str(JOB), folder],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        stdout, stderr = job.communicate()
        pytest.fail(f"the Ray Train job did not finish within {JOB_TIMEOUT_S} s:\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def ray_run():
    """The job's report (its last line), once; the run's processes and files are gone afterwards."""
    # Short and outside pytest's deep tmp_path: Ray's Unix sockets live under it (108-byte path limit).
    folder, run = tempfile.mkdtemp(prefix="accel-ray-", dir="/tmp"), uuid.uuid4().hex
    try:
        started = time.monotonic()
        job = _run_job(folder, run)
        elapsed = time.monotonic() - started
    finally:
        leftovers = _leftovers(run)
        shutil.rmtree(folder, ignore_errors=True)
    assert not leftovers, f"Ray processes left behind after ray.shutdown(): {leftovers}"
    assert job.returncode == 0, f"the Ray Train job failed:\n{job.stderr[-6000:]}"
    report = json.loads(job.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    report["elapsed_s"] = elapsed
    return report


def test_every_address_is_loopback(ray_run):
    addresses = ray_run["addresses"]
    seen = [addresses["node_ip"], addresses["gcs"], *addresses["nodes"]]
    seen += [worker["MASTER_ADDR"] for worker in ray_run["workers"]]
    assert all(ipaddress.ip_address(address).is_loopback for address in seen), seen
    assert all(worker["GLOO_SOCKET_IFNAME"] == "lo" for worker in ray_run["workers"])


def test_the_accelerator_adopts_rays_group(ray_run):
    shared = "accel" if _ext.status().loaded else "gloo"
    assert [worker["rank"] for worker in ray_run["workers"]] == [0, 1]
    for worker in ray_run["workers"]:
        assert worker["group_before_accel"] and worker["backend_before"] == "gloo"  # Ray made the group
        assert worker["backend_after"] == shared  # one host: its CPU collectives through shared memory
        assert worker["num_processes"] == 2
        assert worker["LOCAL_RANK"] == str(worker["rank"]) and worker["local_process_index"] == worker["rank"]


def test_data_are_sharded_per_worker(ray_run):
    first, second = (set(worker["samples"]) for worker in ray_run["workers"])
    assert len(first) == len(second) == 12 and not first & second and first | second == set(range(24))


def test_the_save_state_folder_is_the_reported_checkpoint(ray_run):
    checkpoint = ray_run["checkpoint"]
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"):
        assert name in checkpoint["files"]
    assert checkpoint["keys"] == ["bias", "weight"]
    assert ray_run["metrics"]["epoch"] == 1  # the last of 2 epochs
    # The data's targets have a variance of about 8 and noise of 0.0025: the saved weights learned the problem.
    assert checkpoint["loss"] < 0.1 and ray_run["metrics"]["loss"] < 1.0
