"""HF Accelerate's own multi-process test scripts, imports renamed to accel, pass under `accel launch`.

The scripts come from the HF Accelerate 1.15 package installed beside accel (the test extra pins it); nothing of
HF's is kept in this repository. Each is copied with `accelerate` renamed to `accel` and run on 2 CPU processes.
The scripts that do not pass under HF Accelerate itself on a CPU machine are left out (README, "Switching from HF
Accelerate": test_ddp_comm_hook assumes GPUs, test_notebook's fault-tolerance case hangs, test_metrics needs the
Hub).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = ["test_ops", "test_sync", "test_script", "test_cli", "test_distributed_data_loop"]


def hf_scripts_folder() -> Path | None:
    spec = importlib.util.find_spec("accelerate")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "test_utils" / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_hf_script_passes_under_accel_launch(tmp_path, name):
    folder = hf_scripts_folder()
    if folder is None:
        pytest.skip("HF Accelerate is not installed (pip install accelerate==1.15.0)")
    script = tmp_path / f"{name}.py"
    script.write_text(re.sub(r"\baccelerate\b", "accel", (folder / f"{name}.py").read_text()))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "accel", "launch", "--cpu", "--num_processes", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"{name} failed under accel launch:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )


def test_accel_never_imports_hf_accelerate():
    # HF Accelerate is installed beside accel in the test environment: no accel module may lean on it.
    code = (
        "import importlib, pkgutil, sys, accel\n"
        "for info in pkgutil.walk_packages(accel.__path__, 'accel.'):\n"
        # accel._C loads through accel._ext; accel.__main__ runs the CLI
        "    if info.name not in ('accel._C', 'accel.__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'accelerate'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
