"""What the benchmarks that launch 2-process jobs share (bench_fsdp2.py, bench_hf_stack.py): a loopback port, a
launch bounded by a deadline that ends every rank with it, and the losses' relative difference."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A free TCP port on the loopback interface (jobs rendezvous on 127.0.0.1 only)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command: list[str], env: dict[str, str], cwd: Path, what: str, timeout_s: float) -> None:
    """Runs one launch in a session of its own; fails with its output when it fails or outlives `timeout_s`
    (then it is ended with all its ranks)."""
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
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
