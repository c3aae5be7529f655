"""Guards that fail a test which leaks state into the next one, and clean that state up.

After every test: the accel singletons are reset; a test that left environment variables changed, a process group
initialized, child processes alive or new /dev/shm entries fails (at teardown) naming what leaked, after the leak
is undone. The hardware and build a test needs is a marker, checked here once: `@pytest.mark.gpu` (a CUDA device),
`@pytest.mark.native` (accel's native extension loaded), `@pytest.mark.native_cuda` (a CUDA device and accel's CUDA
kernels); a test that needs what is missing is skipped, saying why.
"""

from __future__ import annotations

import os

import psutil
import pytest
import spawn_pool
import torch
import torch.distributed as dist

from accel import _ext
from accel.state import AcceleratorState, GradientState, PartialState

SHM_DIR = "/dev/shm"
# pytest rewrites the first between setup, call and teardown; mlflow sets the second when imported (DeepSpeed's
# import imports it) and clears it when a run ends.
_IGNORED_ENV = {"PYTEST_CURRENT_TEST", "_MLFLOW_TELEMETRY_SESSION_ID"}
# Process-wide settings torch (inductor, opcheck) and DeepSpeed's import export once and keep for the process: not
# a test's leak.
_TORCH_SET_ONCE = (
    "TORCHINDUCTOR_",
    "_TORCHINDUCTOR_",
    "TRITON_",
    "TORCH_WARM_POOL",
    "KMP_DUPLICATE_LIB_OK",
    "CUBLAS_WORKSPACE_CONFIG",
    "KMP_INIT_AT_FORK",  # the last: Intel OpenMP, on a GPU image
    "PYTORCH_NVML_BASED_CUDA_CHECK",
)  # set by `import deepspeed`


def _missing(marker: str) -> str | None:
    """Why a test marked `marker` cannot run here, or None when it can."""
    status = _ext.status()
    if marker in ("gpu", "native_cuda") and not torch.cuda.is_available():
        return "needs a CUDA device"
    if marker in ("native", "native_cuda") and not status.loaded:
        return f"native extension not loaded: {status.reason}"
    if marker == "native_cuda" and not status.cuda_kernels:
        return "needs accel's CUDA kernels (this build has none)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in ("gpu", "native", "native_cuda"):
        reason = _missing(marker) if item.get_closest_marker(marker) is not None else None
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture(autouse=True, scope="session")
def _shutdown_rank_pools():
    yield
    spawn_pool.shutdown_pools()


@pytest.fixture(autouse=True)
def _reset_accel_state():
    yield
    PartialState._reset_state()
    AcceleratorState._reset_state()
    GradientState._reset_state()


# --- Environment ---------------------------------------------------------------------------------------------------


def _env_changes(before: dict[str, str]) -> dict[str, str]:
    """Leaked names, each marked +added, -removed or ~changed."""
    after = os.environ
    added = {key: "+" for key in after.keys() - before.keys() if not key.startswith(_TORCH_SET_ONCE)}
    removed = {key: "-" for key in before.keys() - after.keys()}
    changed = {key: "~" for key in before.keys() & after.keys() if before[key] != after[key]}
    changes = {**added, **removed, **changed}
    return {key: changes[key] for key in sorted(changes) if key not in _IGNORED_ENV}


@pytest.fixture(autouse=True)
def _no_env_leak():
    before = dict(os.environ)
    yield
    leaked = _env_changes(before)
    for key in leaked:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    if leaked:
        names = ", ".join(mark + key for key, mark in leaked.items())
        pytest.fail(f"the test changed environment variables (+added -removed ~changed): {names}")


# --- Process group -------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_process_group_leak():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialized")


# --- Child processes -----------------------------------------------------------------------------------------------


def _helper_pids() -> set[int]:
    """Long-lived children that belong to the session: rank pools and multiprocessing's resource tracker."""
    from multiprocessing import resource_tracker

    tracker_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return spawn_pool.pool_pids() | ({tracker_pid} if tracker_pid else set())


def _stray_children() -> list[psutil.Process]:
    helpers = _helper_pids()
    return [child for child in psutil.Process().children(recursive=True) if child.pid not in helpers]


@pytest.fixture(autouse=True)
def _no_child_process_leak():
    yield
    stray = _stray_children()
    if not stray:
        return
    _, alive = psutil.wait_procs(stray, timeout=2.0)  # give children that are exiting a moment
    if alive:
        names = ", ".join(f"{child.pid} ({' '.join(child.cmdline()[:3]) or child.name()})" for child in alive)
        for child in alive:
            child.kill()
        psutil.wait_procs(alive, timeout=5.0)
        pytest.fail(f"the test left child processes alive: {names}")


# --- Shared memory -------------------------------------------------------------------------------------------------


def _own_shm_entries() -> set[str]:
    if not os.path.isdir(SHM_DIR):
        return set()
    uid = os.getuid()
    with os.scandir(SHM_DIR) as entries:
        return {entry.name for entry in entries if _owned_by(entry, uid)}


def _owned_by(entry: os.DirEntry, uid: int) -> bool:
    try:
        return entry.stat(follow_symlinks=False).st_uid == uid
    except FileNotFoundError:
        return False


def _held_by_others(paths: set[str]) -> set[str]:
    """The paths that a process outside this pytest's process tree has open or mapped (a concurrent run's)."""
    ours = {os.getpid()} | {child.pid for child in psutil.Process().children(recursive=True)}
    held = set()
    for proc in psutil.process_iter():
        if proc.pid in ours:
            continue
        try:
            held |= paths & {item.path for item in proc.memory_maps(grouped=False)}
            held |= paths & {item.path for item in proc.open_files()}
        except (psutil.Error, OSError):
            continue
    return held


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture(autouse=True)
def _no_shm_leak():
    before = _own_shm_entries()
    yield
    new = {os.path.join(SHM_DIR, name) for name in _own_shm_entries() - before}
    leaked = sorted(new - _held_by_others(new)) if new else []
    for path in leaked:
        _remove(path)
    if leaked:
        pytest.fail(f"the test left shared-memory entries behind: {', '.join(leaked)}")
