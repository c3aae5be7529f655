"""Loads the native extension ``accel._C`` once and remembers why, when it could not.

Every native call site asks :func:`native_for` first and falls back to the pure-torch reference, so a
missing or broken build costs speed, never correctness. ``ACCEL_DISABLE_NATIVE=1`` skips the load.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import warnings
from pathlib import Path

import torch

_BUILD_INFO = Path(__file__).with_name("_build_info.json")
_REBUILD = "rebuild it: pip install --no-build-isolation -e . (ACCEL_BUILD_NATIVE=1 makes a failed compile an error)"


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """What `accel env` reports about the native kernels."""

    loaded: bool
    reason: str | None
    build_info: dict
    fix: str | None = None

    @property
    def cuda_kernels(self) -> bool:
        return self.loaded and has_kernel("pad_into", "CUDA")


def read_build_info(path: Path = _BUILD_INFO) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def diagnose_missing(info: dict) -> NativeStatus:
    if info.get("build_error"):
        return NativeStatus(False, f"the native build failed at install: {info['build_error']}", info, _REBUILD)
    if info:
        return NativeStatus(False, "accel._C is missing although the build recorded success", info, _REBUILD)
    return NativeStatus(
        False,
        "accel was installed without its native extension (ACCEL_BUILD_NATIVE=0, or torch was not importable at "
        "build time)",
        info,
        _REBUILD,
    )


def try_load(module: str = "accel._C", info: dict | None = None) -> NativeStatus:
    """Imports the extension module and classifies a failure into a reason a user can act on."""
    info = read_build_info() if info is None else info
    if os.environ.get("ACCEL_DISABLE_NATIVE", "0") not in ("", "0"):
        return NativeStatus(False, "disabled by ACCEL_DISABLE_NATIVE=1", info, "unset ACCEL_DISABLE_NATIVE")
    if info.get("build_error"):
        # A library left over from an earlier build may still be there; it is not this source's.
        return diagnose_missing(info)
    built_for = info.get("torch")
    if built_for and built_for != torch.__version__:  # the local suffix (+cpu, +cu130) is part of the ABI too
        # Loading a library built against another torch can crash instead of raising: don't try.
        return NativeStatus(False, f"built for torch {built_for}, you have {torch.__version__}", info, _REBUILD)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise  # something the extension itself imports is missing: a bug, not a missing build
        return diagnose_missing(info)
    except (ImportError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if "undefined symbol" in str(exc):
            reason += " (the extension was built against another torch or compiler; a torch upgrade does this)"
        return NativeStatus(False, reason, info, _REBUILD)
    return NativeStatus(True, None, info)


@functools.cache
def status() -> NativeStatus:
    """Loads the extension on first call; warns once, with the reason, when it is unusable."""
    result = try_load()
    explicitly_disabled = result.reason is not None and result.reason.startswith("disabled by")
    if not result.loaded and not explicitly_disabled:
        warnings.warn(
            f"accel: native kernels unavailable, using pure-torch fallbacks: {result.reason}. Fix: {result.fix}",
            RuntimeWarning,
            stacklevel=2,
        )
    return result


def native_for(op: str, device: torch.device | str) -> bool:
    """True when accel._C is loaded and registers `accel::<op>` for this device type."""
    return _native_for_device_type(op, torch.device(device).type)


@functools.cache
def _native_for_device_type(op: str, device_type: str) -> bool:
    # Cached: the dispatcher lookup costs tens of microseconds, a noticeable share of a small collective or of an
    # unscale-and-clip step; kernels are registered once, when status() loads the library.
    if not status().loaded:
        return False
    dispatch_key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return dispatch_key is not None and has_kernel(op, dispatch_key)


def has_kernel(op: str, dispatch_key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"accel::{op}", dispatch_key)
    except RuntimeError:  # no such operator
        return False
