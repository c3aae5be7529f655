"""The process's environment: settings read from environment variables, temporary changes to `os.environ`, and the
machine (GPUs, kernel, ports) asked about without initializing any device.

HF Accelerate's `accelerate.utils.environment` names, with its semantics. Torch-free at import, so the CLI can use
it; functions that need torch import it when called.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable

logger = logging.getLogger(__name__)

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
# Both spellings of accel's settings: ours (ACCEL_*) and those HF Accelerate's launcher exports (ACCELERATE_*).
SETTING_PREFIXES = ("ACCEL_", "ACCELERATE_")
_FORBIDDEN_IN_ENV_LINES = (";", "\n", "<", ">", " ")
# The options of torch's launcher (torch.distributed.run), without dashes, as HF Accelerate lists them.
TORCH_LAUNCH_PARAMS = [
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "m",
    "no_python",
    "run_path",
    "log_dir",
    "r",
    "redirects",
    "t",
    "tee",
    "node_rank",
    "master_addr",
    "master_port",
]


# --- reading settings --------------------------------------------------------------------------------------------


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Reads a string as a truth value: 1 (True) for y/yes/t/true/on/1, 0 (False) for n/no/f/false/off/0, any case.

    Args:
        value: The string to read.
        to_bool: Return `True`/`False` instead of HF's `1`/`0`.

    Raises:
        ValueError: `value` is none of those.
    """
    lowered = value.lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {', '.join(_TRUE)} or {', '.join(_FALSE)}")


def get_int_from_env(env_keys: Iterable[str], default: int) -> int:
    """The value of the first variable of `env_keys` that is set to a non-negative integer, else `default`.

    Raises:
        ValueError: a variable is set to something that is not an integer (named in the message).
    """
    for key in env_keys:
        raw = os.environ.get(key, "-1")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether variable `key` is set to a true value (see `str_to_bool`); `default` when it is unset.

    Raises:
        ValueError: `key` is set to something that is not a truth value (named in the message).
    """
    value = os.environ.get(key, str(default))
    try:
        return str_to_bool(value) == 1
    except ValueError as error:
        raise ValueError(f"environment variable {key}: {error}") from None


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The value of variable `key`, or `str(default)` when it is unset."""
    return os.environ.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among `library_names` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]


@dataclasses.dataclass
class CPUInformation:
    """Where this process stands in a (CPU) distributed run.

    Attributes:
        rank: The rank of the process.
        world_size: The number of processes in the run.
        local_rank: The rank of the process on its machine.
        local_world_size: The number of processes on its machine.
    """

    rank: int = dataclasses.field(default=0, metadata={"help": "The rank of the current process."})
    world_size: int = dataclasses.field(default=1, metadata={"help": "The total number of processes in the world."})
    local_rank: int = dataclasses.field(
        default=0, metadata={"help": "The rank of the current process on the local node."}
    )
    local_world_size: int = dataclasses.field(
        default=1, metadata={"help": "The total number of processes on the local node."}
    )


def get_cpu_distributed_information() -> CPUInformation:
    """This process's rank, world size, local rank and local world size, as torchrun or an MPI launcher
    (Intel MPI / MPICH's PMI_*, Open MPI's OMPI_COMM_WORLD_*, MVAPICH's MV2_*) set them; 0/1/0/1 when unset."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(
            ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"], 0
        ),
        local_world_size=get_int_from_env(
            ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"], 1
        ),
    )


# --- changing os.environ -----------------------------------------------------------------------------------------


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """`KEY=value\\n` lines for an environment file, leaving out (with a warning) entries that are empty or hold
    characters a shell or the file format would misread (`;`, a newline, `<`, `>`, a space).

    Example::

        convert_dict_to_env_variables({"ACCEL_DEBUG_MODE": "1", "BAD": "<x", "OTHER": "2"})
        # ["ACCEL_DEBUG_MODE=1\\n", "OTHER=2\\n"]
    """
    lines = []
    for key, value in current_env.items():
        if key and value and not any(char in key + value for char in _FORBIDDEN_IN_ENV_LINES):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning("Skipping %s=%s: it is empty or contains forbidden characters.", key, value)
    return lines


@contextmanager
def clear_environment() -> Iterator[None]:
    """Empties `os.environ` for the duration of the block, then restores it exactly as it was (variables set
    inside the block are dropped).

    Example::

        with clear_environment():
            os.environ["FOO"] = "new"    # only FOO is set here
        # the previous environment is back, without this FOO
    """
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def variables_restored(names: Iterable[str]) -> Iterator[None]:
    """Afterwards, each environment variable of `names` has its value of the start again, or is unset if it was
    unset then (whatever the block did to it)."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Sets each keyword as an environment variable (name upper-cased, value `str()`-ed) for the duration of the
    block; afterwards each one has its previous value again, or is unset if it was unset.

    Example::

        with patch_environment(foo="bar"):
            os.environ["FOO"]   # "bar"
    """
    variables = {key.upper(): str(value) for key, value in kwargs.items()}
    with variables_restored(variables):
        os.environ.update(variables)
        yield


@contextmanager
def _settings_restored() -> Iterator[None]:
    """Restores every ACCEL_* and ACCELERATE_* variable to what it was on entry (removing new ones)."""
    saved = {key: value for key, value in os.environ.items() if key.startswith(SETTING_PREFIXES)}
    try:
        yield
    finally:
        for key in [key for key in os.environ if key.startswith(SETTING_PREFIXES)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def _purging(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with _settings_restored():
            return function(*args, **kwargs)

    wrapper._accelerate_is_purged_environment_wrapped = True
    return wrapper


def _purge_test_methods(cls: type) -> type:
    for name in dir(cls):
        method = getattr(cls, name)
        wrapped = hasattr(method, "_accelerate_is_purged_environment_wrapped")
        if name.startswith("test") and callable(method) and not wrapped:
            setattr(cls, name, _purging(method))
    return cls


def purge_accelerate_environment(func_or_cls: Callable | type) -> Callable | type:
    """Decorator: the ACCEL_* and ACCELERATE_* variables a function (or each `test*` method of a class and of its
    subclasses) sets or changes are undone when it returns.

    For instance `TrainingArguments(fp16=True)` exports ACCELERATE_MIXED_PRECISION=fp16, which then overrides the
    next test's settings. HF Accelerate clears ACCELERATE_* only; accel reads both spellings, so both are restored.
    """
    if not isinstance(func_or_cls, type):
        return _purging(func_or_cls)
    _purge_test_methods(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kwargs: _purge_test_methods(cls))
    return func_or_cls


# --- the machine -------------------------------------------------------------------------------------------------


def _nvidia_smi() -> str:
    """The nvidia-smi command (on Windows, its default install path when it is not on PATH)."""
    if platform.system() == "Windows" and shutil.which("nvidia-smi") is None:
        return f"{os.environ.get('systemdrive', 'C:')}\\Program Files\\NVIDIA Corporation\\NVSMI\\nvidia-smi.exe"
    return "nvidia-smi"


def query_gpus(*fields: str) -> list[list[str]]:
    """One row per GPU of `nvidia-smi --query-gpu=<fields>` (all GPUs of the machine, in PCI order, whatever
    CUDA_VISIBLE_DEVICES says). Does not initialize CUDA.

    Raises:
        FileNotFoundError: nvidia-smi is not installed.
        subprocess.CalledProcessError: nvidia-smi failed (e.g. no driver).
    """
    output = subprocess.check_output(
        [_nvidia_smi(), f"--query-gpu={','.join(fields)}", "--format=csv,noheader"], universal_newlines=True
    )
    return [[value.strip() for value in line.split(",")] for line in output.strip().splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """(names, count) of the machine's NVIDIA GPUs, from nvidia-smi, so CUDA is not initialized.

    Raises:
        FileNotFoundError / subprocess.CalledProcessError: as `query_gpus`.
    """
    names = [row[-1] for row in query_gpus("count", "name")]
    return names, len(names)


def get_driver_version() -> str:
    """The NVIDIA driver version (of the first GPU), from nvidia-smi."""
    return query_gpus("driver_version")[0][0]


def check_cuda_p2p_ib_support() -> bool:
    """False when several consumer GPUs of a generation whose peer-to-peer / InfiniBand transfers NCCL must not
    use (RTX 40xx) run with a driver older than 550.40.07; True otherwise, and whenever nvidia-smi cannot tell.

    Uses nvidia-smi, so CUDA is not initialized.
    """
    from packaging.version import parse

    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            return parse(get_driver_version()) >= parse("550.40.07")
    except Exception:  # no nvidia-smi, no driver, unreadable output: nothing known to be unsupported
        pass
    return True


@functools.lru_cache
def check_cuda_fp8_capability() -> bool:
    """Whether the first GPU can compute in FP8 (compute capability 8.9 or higher: Ada, Hopper and later).

    Asks nvidia-smi first; if that fails, torch (which initializes CUDA). Unlike HF Accelerate, which raises on a
    machine without CUDA, the answer there is False. Cached.
    """
    try:
        capability = tuple(int(part) for part in query_gpus("compute_capability")[0][0].split("."))
    except Exception:
        import torch

        if not torch.cuda.is_available():
            return False
        capability = torch.cuda.get_device_capability()
    return capability >= (8, 9)


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on TCP `port` (default 29500, torch's rendezvous port) on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", 29500 if port is None else port)) == 0


def get_free_port(address: str = "") -> int:
    """A TCP port nothing listens on right now (the OS's choice), e.g. for a rendezvous.

    Args:
        address: The address to find it on (default: every address of this machine, as HF's).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


_MIN_KERNEL = (5, 5, 0)


def check_os_kernel() -> None:
    """Warns (on the main process) when Linux runs a kernel older than 5.5.0, with which distributed jobs can hang
    (HF Accelerate issue #1929). Does nothing on other systems or when the release cannot be read."""
    info = platform.uname()
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if info.system != "Linux" or match is None:
        return
    version = tuple(int(part) for part in match.groups())
    if version >= _MIN_KERNEL:
        return
    message = (
        f"Detected kernel version {match.group(0)}, which is below the recommended minimum of 5.5.0; this can "
        "cause the process to hang. It is recommended to upgrade the kernel to the minimum version or higher."
    )
    if _is_main_process():
        logger.warning(message)


def _is_main_process() -> bool:
    """Rank 0 of the default process group, or any process without one (PartialState's `is_main_process`, read
    from torch.distributed: this module sits below accel.state). torch is imported only when it already is."""
    distributed = sys.modules.get("torch.distributed")
    return distributed is None or not distributed.is_initialized() or distributed.get_rank() == 0
