"""The native extension loader: it loads when built, and says why (with a fix) when it cannot."""

import importlib.util
import os
import sys

import pytest
import torch

from accel import _ext


def test_the_suite_runs_in_the_mode_it_was_asked_for():
    # make test-native sets ACCEL_EXPECT_NATIVE=1: a build that silently fell back must fail here, not skip.
    expected = os.environ.get("ACCEL_EXPECT_NATIVE")
    if expected is None:
        pytest.skip("ACCEL_EXPECT_NATIVE not set (the Makefile sets it)")
    assert _ext.status().loaded == (expected == "1"), _ext.status().reason


@pytest.mark.skipif(os.environ.get("ACCEL_EXPECT_PURE_INSTALL") != "1", reason="only in the pure-Python install")
def test_pure_install_has_no_extension_and_says_so():
    assert importlib.util.find_spec("accel._C") is None
    status = _ext.try_load()
    assert not status.loaded and "installed without its native extension" in status.reason


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("ACCEL_DISABLE_NATIVE", "1")
    status = _ext.try_load()
    assert not status.loaded and status.reason == "disabled by ACCEL_DISABLE_NATIVE=1"


def test_built_for_another_torch_is_not_loaded(monkeypatch):
    monkeypatch.delenv("ACCEL_DISABLE_NATIVE", raising=False)
    status = _ext.try_load(info={"torch": "1.13.0+cpu"})
    assert not status.loaded
    assert status.reason == f"built for torch 1.13.0+cpu, you have {torch.__version__}"
    assert "pip install --no-build-isolation" in status.fix


def test_a_failed_build_reports_the_compile_error(monkeypatch):
    monkeypatch.delenv("ACCEL_DISABLE_NATIVE", raising=False)
    info = {"torch": torch.__version__, "native": False, "build_error": "CompileError: pad_into.cpp:3: error: boom"}
    status = _ext.try_load("accel_no_such_package._C", info=info)
    assert not status.loaded and "native build failed at install: CompileError: pad_into.cpp:3" in status.reason


def test_a_missing_module_without_build_info_says_it_was_not_built(monkeypatch):
    monkeypatch.delenv("ACCEL_DISABLE_NATIVE", raising=False)
    status = _ext.try_load("accel_no_such_package._C", info={})
    assert not status.loaded and "installed without its native extension" in status.reason


def test_a_corrupt_library_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.delenv("ACCEL_DISABLE_NATIVE", raising=False)
    package = tmp_path / "broken_accel_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (package / f"_C{suffix}").write_bytes(b"not an ELF file " * 256)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        status = _ext.try_load("broken_accel_pkg._C", info={"torch": torch.__version__})
    finally:
        sys.modules.pop("broken_accel_pkg", None)
    assert not status.loaded and status.reason.startswith("ImportError:") and "invalid ELF header" in status.reason


def test_native_for_knows_which_devices_have_kernels():
    if not _ext.status().loaded:
        assert not _ext.native_for("pad_into", "cpu")
        return
    assert _ext.native_for("pad_into", "cpu")
    assert not _ext.native_for("pad_into", "meta")
    assert not _ext.native_for("no_such_op", "cpu")
