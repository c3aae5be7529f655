"""setup.py for real: a native compile failure installs pure Python and records why, unless ACCEL_BUILD_NATIVE=1.

The broken file is the one setup.py compiles first (the generic copy of its first VEC_SOURCES file), its error is
fatal at once (a missing include) and the builds compile one file at a time: each build stops within seconds
instead of compiling the whole extension. Still slow (two pip builds), so it runs once, in the native leg.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from accel import _ext

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("ACCEL_EXPECT_NATIVE") != "1", reason="runs in the native leg only"),
]


def broken_source_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    shutil.copytree(
        ROOT / "accel", tree / "accel", ignore=shutil.ignore_patterns("*.so", "_build_info.json", "__pycache__")
    )
    first = sorted((tree / "csrc" / "cpu" / "vec").glob("*.cpp"))[0]  # setup.py compiles these first
    first.write_text('#include "deliberate_compile_error.h"\n' + first.read_text())
    return tree


def build_wheel(tree: Path, out: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_BUILD")} | {"MAX_JOBS": "1"} | env
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "-q",
        str(tree),
        "-w",
        str(out),
    ]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)
def test_a_broken_native_build_installs_pure_python_and_records_the_compiler_error(tmp_path):
    tree = broken_source_tree(tmp_path)
    result = build_wheel(tree, tmp_path / "dist")
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("accel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = json.loads(archive.read("accel/_build_info.json"))
    assert not [n for n in names if n.startswith("accel/_C")], names
    assert info["native"] is False
    assert "/vec/" in info["build_error"] and "deliberate_compile_error" in info["build_error"]

    status = _ext.try_load("accel_wheel_without_extension._C", info=info)
    assert not status.loaded and "deliberate_compile_error" in status.reason and "pip install" in status.fix

    strict = build_wheel(tree, tmp_path / "strict", ACCEL_BUILD_NATIVE="1")
    assert strict.returncode != 0 and "deliberate_compile_error" in strict.stdout + strict.stderr
