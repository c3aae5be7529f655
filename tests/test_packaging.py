"""The installed package's metadata agrees with the source: its version is written once, in accel/__init__.py."""

import importlib.metadata
from pathlib import Path

import pytest

import accel

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("accel") == accel.__version__
