"""What the benchmarks that launch 2-process jobs share (bench_fsdp2.py, bench_deepspeed.py, bench_hf_stack.py): a
loopback port, the jobs' environment, a launch bounded by a deadline that ends every rank with it, the losses'
relative difference and the per-round ratios."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a job would inherit from this process that changes what it does: accel's, HF's and DeepSpeed's settings, a
# launcher's rank variables, thread counts, malloc settings.
_DROPPED = (
    "ACCEL_",
    "ACCELERATE_",
    "FSDP_",
    "DS_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "OMP_NUM_THREADS",
    "PYTEST_",
    "GLIBC_TUNABLES",
    "MALLOC_",
)


def free_port() -> int:
    """A free TCP port on the loopback interface (jobs rendezvous on 127.0.0.1 only)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accel_launch(port: str, *args: str) -> list[str]:
    """`accel launch` of 2 CPU processes meeting on 127.0.0.1:`port`, then `args` (flags, the job, its arguments)."""
    address = ["--main_process_ip", "127.0.0.1", "--main_process_port", port]
    return [sys.executable, "-m", "accel", "launch", "--cpu", "--num_processes", "2", *address, *args]


def job_env(**extra: str) -> dict[str, str]:
    """The same environment for every job: this one without the settings that change a job (`_DROPPED`), offline,
    one thread per rank, this checkout's accel first on the path; `extra` on top."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(_DROPPED)}
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    return env


def launch(command: list[str], env: dict[str, str], cwd: Path, what: str, timeout_s: float) -> None:
    """Runs one launch in a session of its own; fails with its output when it fails or outlives `timeout_s`
    (then it is ended with all its ranks)."""
    with subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise AssertionError(f"{what} ran past {timeout_s} s:\n{stdout[-3000:]}\n{stderr[-5000:]}") from None
    assert process.returncode == 0, f"{what} failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"


def relative_difference(a: list[float], b: list[float]) -> float:
    """The largest relative difference of `a` from `b`, element by element (same non-zero lengths)."""
    assert len(a) == len(b) > 0, (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def per_round_ratio(numerators: list[float], denominators: list[float]) -> dict:
    """The median and quartiles (inclusive) of the per-round ratios."""
    ratios = sorted(a / b for a, b in zip(numerators, denominators))
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}
