"""What test suites written for HF Accelerate import from `accelerate.test_utils.testing`: the device the tests run
on, `require_*` decorators (true checks through accel.availability), subprocess helpers, test case classes.

Every `require_*` decorator is `unittest.skipUnless(condition, reason)`, so it works on unittest and pytest tests
alike; the condition is evaluated when the test is decorated (as in HF). pytest is not needed to import this module.
"""

from __future__ import annotations

import inspect
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import unittest
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, Any
from unittest import mock

import torch

import accel
from accel import availability
from accel.collectives import gather
from accel.environment import check_cuda_fp8_capability, parse_flag_from_env, variables_restored
from accel.state import AcceleratorState, GradientState, PartialState

# --- the device tests run on -------------------------------------------------------------------------------------

_PLUGIN_DEVICES = ("mlu", "sdaa", "musa", "npu", "xpu", "hpu", "neuron")  # HF's order after CUDA and MPS


def get_backend() -> tuple[str, int, Callable[[], int]]:
    """(device type, number of devices, a function giving the memory allocated on the current device), for the first
    accelerator found in HF's order (XLA, CUDA, MPS, MLU, SDAA, MUSA, NPU, XPU, HPU, Neuron), else the CPU."""
    if availability.is_torch_xla_available():
        return "xla", torch.cuda.device_count(), torch.cuda.memory_allocated
    if availability.is_cuda_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    if availability.is_mps_available(min_version="2.0"):
        return "mps", 1, torch.mps.current_allocated_memory
    if availability.is_mps_available():
        return "mps", 1, lambda: 0
    for name in _PLUGIN_DEVICES:
        if getattr(availability, f"is_{name}_available")():
            module = getattr(torch, name)
            return name, module.device_count(), module.memory_allocated
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()


def get_launch_command(**kwargs: Any) -> list[str]:
    """`["accel", "launch", ...]` with `--key=value` per keyword (`--key` for True; False and None are left out).

    Example:
        >>> get_launch_command(num_processes=2, cpu=True)
        ['accel', 'launch', '--num_processes=2', '--cpu']
    """
    command = ["accel", "launch"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value is not None and value is not False:
            command.append(f"--{key}={value}")
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)

# --- decorators --------------------------------------------------------------------------------------------------

_run_slow_tests = parse_flag_from_env("RUN_SLOW", default=False)


def skip(test_case: Callable) -> Callable:
    """Skips the test unconditionally."""
    return unittest.skip("Test was skipped")(test_case)


def slow(test_case: Callable) -> Callable:
    """Marks a slow test: skipped unless the environment variable RUN_SLOW is true."""
    return unittest.skipUnless(_run_slow_tests, "test is slow")(test_case)


def run_first(test_case: Callable) -> Callable:
    """Orders the test first when the pytest-order plugin is installed (for tests that launch processes on a device
    only one process may use at a time); the test unchanged without pytest."""
    if availability.is_pytest_available():
        import pytest

        return pytest.mark.order(1)(test_case)
    return test_case


def _requirement(condition: Callable[[], bool], reason: str, doc: str) -> Callable[[Callable], Callable]:
    """A decorator skipping its test unless `condition()` (asked when a test is decorated)."""

    def decorator(test_case: Callable) -> Callable:
        return unittest.skipUnless(condition(), reason)(test_case)

    decorator.__doc__ = doc
    return decorator


def _no_xla() -> bool:
    return not availability.is_torch_xla_available()


def _fp8_usable() -> bool:
    """An FP8 library and, on CUDA, a GPU that computes in FP8 (not a first-generation Gaudi either)."""
    usable = availability.is_fp8_available()
    if torch.cuda.is_available() and not check_cuda_fp8_capability():
        usable = False
    if availability.is_hpu_available() and availability.is_habana_gaudi1():
        usable = False
    return usable


def _any_tracker() -> bool:
    trackers = ("wandb", "tensorboard", "trackio", "swanlab")
    found = any(getattr(availability, f"is_{name}_available")() for name in trackers)
    return found and not availability.is_comet_ml_available()


def _transformers_at_least(version: str) -> bool:
    return availability.is_transformers_available() and availability.compare_versions("transformers", ">=", version)


# Devices.
require_cpu = _requirement(
    lambda: torch_device == "cpu", "test requires only a CPU", "Runs the test only when no accelerator is present."
)
require_non_cpu = _requirement(
    lambda: torch_device != "cpu", "test requires a GPU", "Runs the test only when an accelerator is present."
)
require_cuda = _requirement(
    lambda: availability.is_cuda_available() and _no_xla(),
    "test requires a GPU",
    "Runs the test only with a CUDA GPU (and no TorchXLA).",
)
require_cuda_or_hpu = _requirement(
    lambda: (availability.is_cuda_available() and _no_xla()) or availability.is_hpu_available(),
    "test requires a GPU or HPU",
    "Runs the test only with a CUDA GPU (no TorchXLA) or an HPU.",
)
require_cuda_or_xpu = _requirement(
    lambda: (availability.is_cuda_available() and _no_xla()) or availability.is_xpu_available(),
    "test requires a CUDA GPU or XPU",
    "Runs the test only with a CUDA GPU (no TorchXLA) or an XPU.",
)
require_xpu = _requirement(lambda: availability.is_xpu_available(), "test requires a XPU", "Needs an XPU.")
require_non_xpu = _requirement(lambda: torch_device != "xpu", "test requires a non-XPU", "Skipped on an XPU.")
require_non_hpu = _requirement(lambda: torch_device != "hpu", "test requires a non-HPU", "Skipped on an HPU.")
require_mlu = _requirement(lambda: availability.is_mlu_available(), "test require a MLU", "Needs an MLU.")
require_sdaa = _requirement(lambda: availability.is_sdaa_available(), "test require a SDAA", "Needs an SDAA.")
require_musa = _requirement(lambda: availability.is_musa_available(), "test require a MUSA", "Needs a MUSA device.")
require_npu = _requirement(lambda: availability.is_npu_available(), "test require a NPU", "Needs an NPU.")
require_neuron = _requirement(
    lambda: availability.is_neuron_available(), "test require Neuron Cores", "Needs AWS Neuron cores."
)
require_mps = _requirement(
    lambda: availability.is_mps_available(),
    "test requires a `mps` backend support in `torch`",
    "Needs Apple's MPS backend.",
)
require_tpu = _requirement(
    lambda: availability.is_torch_xla_available(check_is_tpu=True),
    "test requires TPU",
    "Needs a TPU (accel does not run on TPUs: such tests are for code that asks).",
)
require_non_torch_xla = _requirement(_no_xla, "test requires an env without TorchXLA", "Skipped where TorchXLA is.")
require_single_device = _requirement(
    lambda: torch_device != "cpu" and device_count == 1,
    "test requires a single device accelerator",
    "Needs exactly one accelerator.",
)
require_single_gpu = _requirement(
    lambda: torch.cuda.device_count() == 1, "test requires a GPU", "Needs exactly one GPU."
)
require_single_xpu = _requirement(
    lambda: availability.is_xpu_available() and torch.xpu.device_count() == 1,
    "test requires a XPU",
    "Needs exactly one XPU.",
)
require_multi_device = _requirement(
    lambda: device_count > 1, "test requires multiple hardware accelerators", "Needs two or more accelerators."
)
require_multi_gpu = _requirement(
    lambda: torch.cuda.device_count() > 1, "test requires multiple GPUs", "Needs two or more GPUs."
)
require_multi_xpu = _requirement(
    lambda: availability.is_xpu_available() and torch.xpu.device_count() > 1,
    "test requires multiple XPUs",
    "Needs two or more XPUs.",
)
require_multi_gpu_or_xpu = _requirement(
    lambda: (availability.is_cuda_available() or availability.is_xpu_available()) and device_count > 1,
    "test requires multiple GPUs or XPUs",
    "Needs two or more GPUs or XPUs.",
)

# Precisions and parallelism.
require_fp16 = _requirement(lambda: availability.is_fp16_available(), "test requires FP16 support", "Needs fp16.")
require_fp8 = _requirement(
    _fp8_usable,
    "test requires FP8 support",
    "Needs an FP8 library and hardware (accel refuses FP8 training: for code that asks).",
)
require_fsdp2 = _requirement(
    lambda: availability.is_torch_version(">=", "2.5.0"),
    "test requires FSDP2 (torch >= 2.5.0)",
    "Needs torch 2.5+ (FSDP2).",
)
require_tp = _requirement(
    lambda: availability.is_torch_version(">=", "2.3.0") and _transformers_at_least("4.52.0"),
    "test requires torch version >= 2.3.0 and transformers version >= 4.52.0",
    "Needs torch 2.3+ and transformers 4.52+ (tensor parallelism).",
)
require_pippy = _requirement(
    lambda: availability.is_pippy_available() and not availability.is_habana_gaudi1(),
    "test requires pippy",
    "Needs torch.distributed.pipelining (not on Gaudi 1).",
)

# Libraries.
require_huggingface_suite = _requirement(
    lambda: availability.is_transformers_available() and availability.is_datasets_available(),
    "test requires the Hugging Face suite",
    "Needs transformers and datasets.",
)
require_trackers = _requirement(
    _any_tracker,
    "test requires at least one tracker to be available and for `comet_ml` to not be installed",
    "Needs wandb, tensorboard, trackio or swanlab, and comet_ml absent.",
)
_LIBRARIES = {  # decorator name -> (availability function, skip reason)
    "require_peft": ("peft", "test requires PEFT"),
    "require_datasets": ("datasets", "test requires the datasets library"),
    "require_transformers": ("transformers", "test requires the transformers library"),
    "require_timm": ("timm", "test requires the timm library"),
    "require_torchvision": ("torchvision", "test requires the torchvision library"),
    "require_triton": ("triton", "test requires the triton library"),
    "require_schedulefree": ("schedulefree", "test requires the schedulefree library"),
    "require_bnb": ("bnb", "test requires the bitsandbytes library"),
    "require_deepspeed": ("deepspeed", "test requires DeepSpeed"),
    "require_tensorboard": ("tensorboard", "test requires Tensorboard"),
    "require_wandb": ("wandb", "test requires wandb"),
    "require_trackio": ("trackio", "test requires trackio"),
    "require_comet_ml": ("comet_ml", "test requires comet_ml"),
    "require_aim": ("aim", "test requires aim"),
    "require_clearml": ("clearml", "test requires clearml"),
    "require_dvclive": ("dvclive", "test requires dvclive"),
    "require_swanlab": ("swanlab", "test requires swanlab"),
    "require_pandas": ("pandas", "test requires pandas"),
    "require_mlflow": ("mlflow", "test requires mlflow"),
    "require_import_timer": ("import_timer", "test requires tuna interpreter"),
    "require_transformer_engine": ("transformer_engine", "test requires transformers engine"),
    "require_transformer_engine_mxfp8": (
        "transformer_engine_mxfp8",
        "test requires transformers engine MXFP8 block scaling",
    ),
    "require_torchao": ("torchao", "test requires torchao"),
    "require_matplotlib": ("matplotlib", "test requires matplotlib"),
    "require_torchdata_stateful_dataloader": (
        "torchdata_stateful_dataloader",
        "test requires torchdata.stateful_dataloader",
    ),
}
for _name, (_library, _reason) in _LIBRARIES.items():
    globals()[_name] = _requirement(
        getattr(availability, f"is_{_library}_available"),
        _reason,
        f"Runs the test only when accel.availability.is_{_library}_available().",
    )
    globals()[_name].__name__ = globals()[_name].__qualname__ = _name
del _name, _library, _reason


def require_torch_min_version(test_case: Callable | None = None, version: str | None = None) -> Callable:
    """Runs the test only with torch `version` or newer; `@require_torch_min_version(version="2.4")` form too."""
    if test_case is None:
        return partial(require_torch_min_version, version=version)
    return unittest.skipUnless(
        availability.is_torch_version(">=", version), f"test requires torch version >= {version}"
    )(test_case)


# --- test case classes -------------------------------------------------------------------------------------------


class TempDirTestCase(unittest.TestCase):
    """One temporary folder (`self.tmpdir`, a Path) for the whole class: emptied before each test (unless
    `clear_on_setup` is False), removed after the last."""

    clear_on_setup = True

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self) -> None:
        if self.clear_on_setup:
            for path in self.tmpdir.iterdir():
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()


class AccelerateTestCase(unittest.TestCase):
    """Resets the accelerator singletons (`AcceleratorState`, `PartialState`, `GradientState`) after every test, so
    no test sees another's state."""

    def tearDown(self) -> None:
        super().tearDown()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class MockingTestCase(unittest.TestCase):
    """Mocks that every test needs but that can only be built in `setUp`: call `self.add_mocks(...)` at the end of
    `setUp`; they are started now and stopped after the test."""

    def add_mocks(self, mocks: Any) -> None:
        """Starts `mocks` (one `mock.patch...` object or a list of them) and stops them when the test ends."""
        self.mocks = list(mocks) if isinstance(mocks, (tuple, list)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


def mockenv(**kwargs: str) -> Any:
    """A decorator (or context manager) running the test with these environment variables set, restored after."""
    return mock.patch.dict(os.environ, kwargs)


@contextmanager
def mockenv_context(*remove: str, **update: str) -> Iterator[None]:
    """Inside, the variables `update` names are set and those `remove` names are unset; all restored after."""
    with variables_restored([*remove, *update]):
        for name in remove:
            os.environ.pop(name, None)
        os.environ.update(update)
        yield


# --- checks ------------------------------------------------------------------------------------------------------


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is equal on every process (a collective: every process calls it)."""
    local = tensor[None].clone().to(PartialState().device)
    everyone = gather(local).cpu()
    return all(torch.equal(row, local[0].cpu()) for row in everyone)


@contextmanager
def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Iterator[None]:
    """Asserts that the block raises `exception_class` (with `msg` in its message when given)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - checked right here
        assert isinstance(error, exception_class), f"Expected exception of type {exception_class} but got {type(error)}"
        if msg is not None:
            assert msg in str(error), f"Expected message '{msg}' to be in exception but got '{error}'"
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")


def capture_call_output(func: Callable, *args: Any, **kwargs: Any) -> str:
    """What `func(*args, **kwargs)` prints to stdout."""
    captured = io.StringIO()
    original = sys.stdout
    sys.stdout = captured
    try:
        func(*args, **kwargs)
    finally:
        sys.stdout = original
    return captured.getvalue()


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed accel package (`path_in_accelerate_package("commands", "launch.py")`)."""
    return Path(inspect.getfile(accel)).parent.joinpath(*components)


def pytest_xdist_worker_id() -> int:
    """The number of this pytest-xdist worker (`gw3` -> 3); 0 without xdist."""
    return int(re.sub(r"^gw", "", os.environ.get("PYTEST_XDIST_WORKER", "gw0")))


def get_torch_dist_unique_port() -> int:
    """A rendezvous port for `--main_process_port`: 29500 plus the xdist worker number, so concurrent workers do
    not collide."""
    return 29500 + pytest_xdist_worker_id()


# --- subprocesses ------------------------------------------------------------------------------------------------


class _RunOutput:
    """A finished command: `returncode`, and `stdout` / `stderr` as lists of lines (without line ends)."""

    def __init__(self, returncode: int, stdout: list[str], stderr: list[str]):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def _tee(stream: IO[bytes], sink: list[str], echo_to: IO[str] | None, label: str) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip()
        sink.append(line)
        if echo_to is not None:
            print(label, line, file=echo_to)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def execute_subprocess_async(
    cmd: Sequence[Any],
    env: dict | None = None,
    stdin: Any = None,
    timeout: float = 180,
    quiet: bool = False,
    echo: bool = True,
) -> _RunOutput:
    """Runs `cmd`, streaming its output (unless `quiet`) while collecting it, and returns a `_RunOutput`.

    Bounded by `timeout` seconds: past it the command and every process it started (its process group) are killed
    and TimeoutError is raised with what it printed (HF's timeout does not stop the command). A non-zero exit status,
    a death by signal included (HF ignores those), raises RuntimeError with the command's stderr and stdout.
    """
    cmd = [str(part) if isinstance(part, Path) else part for part in cmd]
    command = " ".join(cmd)
    if echo:
        print("\nRunning: ", command)
    process = subprocess.Popen(
        cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(
            target=_tee, args=(process.stdout, out, None if quiet else sys.stdout, "stdout:"), daemon=True
        ),
        threading.Thread(
            target=_tee, args=(process.stderr, err, None if quiet else sys.stderr, "stderr:"), daemon=True
        ),
    ]
    for reader in readers:
        reader.start()
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        _join(readers)
        raise TimeoutError(
            f"'{command}' did not finish within {timeout} s and was killed\n\n{_output(out, err)}"
        ) from None
    except BaseException:
        _kill_group(process)
        raise
    _join(readers)
    if returncode != 0:
        raise RuntimeError(f"'{command}' failed with returncode {returncode}\n\n{_output(out, err)}")
    return _RunOutput(returncode, out, err)


def _join(readers: list[threading.Thread]) -> None:
    for reader in readers:
        reader.join(timeout=5)  # a grandchild that kept the pipe open must not hang the caller


def _output(out: list[str], err: list[str]) -> str:
    return "The combined stderr from workers follows:\n" + "\n".join(err) + "\n\nstdout:\n" + "\n".join(out[-200:])


class SubprocessCallException(Exception):
    """A command run by `run_command` failed; the message holds its output."""


def run_command(command: list[Any], return_stdout: bool = False, env: dict | None = None) -> str | None:
    """Runs `command` (stderr merged into stdout); returns its output with `return_stdout`.

    Raises:
        SubprocessCallException: a non-zero exit status, with the command's output.
    """
    command = [str(part) if isinstance(part, Path) else part for part in command]
    try:
        output = subprocess.check_output(
            command, stderr=subprocess.STDOUT, env=os.environ.copy() if env is None else env
        )
    except subprocess.CalledProcessError as error:
        raise SubprocessCallException(
            f"Command `{' '.join(command)}` failed with the following error:\n\n{error.output.decode()}"
        ) from error
    return output.decode("utf-8") if return_stdout else None
