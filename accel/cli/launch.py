"""`accel launch`: resolve the launch settings once, then hand off to torch.distributed.run.

Settings come in layers, each overriding the one before: LaunchConfig's defaults < the config file
(`--config_file`, else the default one, else HF Accelerate's) < ACCEL_<NAME> environment variables <
command-line flags. Process supervision, rendezvous, restarts and error files are torch's elastic agent's.

Differences from `accelerate launch`, on purpose:
  * `--cpu --num_processes N` starts N processes (HF starts one).
  * Every launch goes through torch.distributed.run, even one process, so children always see the same env.
  * Without `--main_process_port` on one machine, a free port is picked (torchrun --standalone) instead of
    29500, so two jobs on one host do not collide.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import typing
import warnings
from collections.abc import Mapping
from typing import Any

from accel._env import MIXED_PRECISIONS, parse_bool

DYNAMO_KEYS = ("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation")
DEFAULT_PORT = 29500


class LaunchError(ValueError):
    """A launch setting that cannot work; the message names the setting and what is allowed."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything `accel launch` needs, resolved from defaults, config file, env and flags."""

    use_cpu: bool = False
    multi_gpu: bool = False
    gpu_ids: str = "all"
    num_processes: int | None = None
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "static"
    same_network: bool = True
    mixed_precision: str = "no"
    dynamo_backend: str = "NO"
    dynamo_mode: str = "default"
    dynamo_use_fullgraph: bool = False
    dynamo_use_dynamic: bool = False
    dynamo_use_regional_compilation: bool = False
    gradient_accumulation_steps: int | None = None
    debug: bool = False
    ipex: bool = False
    num_cpu_threads_per_process: int | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    module: bool = False
    no_python: bool = False
    training_script: str = ""
    training_script_args: tuple[str, ...] = ()


# ACCEL_<NAME> mirrors each setting; these keep HF Accelerate's names for the children's env.
ENV_NAMES = {"debug": "ACCEL_DEBUG_MODE", "ipex": "ACCEL_USE_IPEX"}
NOT_FROM_ENV = {"training_script", "training_script_args", "module", "no_python"}


def env_name(field: str) -> str:
    return ENV_NAMES.get(field, f"ACCEL_{field.upper()}")


def parse_value(field: str, raw: Any, source: str) -> Any:
    """Converts a config/env/flag value to the field's type, or raises LaunchError naming `source`."""
    kind = typing.get_type_hints(LaunchConfig)[field]
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
    if raw is None or base is str:
        return raw
    if base is bool and isinstance(raw, str):
        try:
            return parse_bool(raw, source)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    try:
        return base(raw)
    except (TypeError, ValueError):
        raise LaunchError(f"{source}: {raw!r} is not a{'n' if base is int else ''} {base.__name__}") from None


def values_from_config_file(path: str | None) -> dict[str, Any]:
    """The LaunchConfig fields a config file sets, keyed by field name."""
    from accel.cli.config_file import find_config_file, load_config

    path = path or find_config_file()
    if path is None:
        return {}
    cluster = load_config(path)
    cluster.check_supported()
    config = cluster.to_dict()
    if config.get("num_processes", -1) < 1:
        config.pop("num_processes", None)  # HF's -1: let the launcher decide
    distributed_type = config.get("distributed_type", "NO")
    values = {
        "use_cpu": config.get("use_cpu", False) or distributed_type == "MULTI_CPU",
        "multi_gpu": distributed_type == "MULTI_GPU",
        "ipex": bool((config.get("ipex_config") or {}).get("ipex", False)),
    }
    for key in ("gpu_ids", "num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                "rdzv_backend", "same_network", "mixed_precision", "debug"):  # fmt: skip
        if config.get(key) is not None:
            values[key] = config[key]
    for key, value in (config.get("dynamo_config") or {}).items():
        if key in DYNAMO_KEYS:
            values[key] = value
    return {k: parse_value(k, v, f"{path}: {k}") for k, v in values.items()}


def values_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for field in dataclasses.fields(LaunchConfig):
        name = env_name(field.name)
        if field.name not in NOT_FROM_ENV and environ.get(name, "") != "":
            values[field.name] = parse_value(field.name, environ[name], name)
    return values


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LaunchError(f"{name}={value!r}: expected one of {', '.join(allowed)}")


def validate(config: LaunchConfig) -> LaunchConfig:
    from accel.cli.config_file import DYNAMO_BACKENDS, DYNAMO_MODES

    config = dataclasses.replace(config, dynamo_backend=config.dynamo_backend.upper())
    check_choice("mixed_precision", config.mixed_precision, MIXED_PRECISIONS)
    check_choice("dynamo_backend", config.dynamo_backend, DYNAMO_BACKENDS)
    check_choice("dynamo_mode", config.dynamo_mode, DYNAMO_MODES)
    if config.module and config.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if config.num_machines < 1 or (config.num_processes is not None and config.num_processes < 1):
        raise LaunchError("num_machines and num_processes must be at least 1")
    if config.num_machines > 1 and not config.main_process_ip:
        raise LaunchError("num_machines > 1 needs main_process_ip (the address of machine_rank 0)")
    if not 0 <= config.machine_rank < config.num_machines:
        raise LaunchError(f"machine_rank={config.machine_rank} must be in [0, num_machines={config.num_machines})")
    if config.num_processes is not None and config.num_processes % config.num_machines:
        raise LaunchError(
            f"num_processes={config.num_processes} is the total over all machines and must divide evenly "
            f"by num_machines={config.num_machines}"
        )
    return config


def resolve(flags: dict[str, Any], environ: Mapping[str, str] = os.environ) -> LaunchConfig:
    """Builds the one LaunchConfig: config file < ACCEL_* env < flags (flags that were not given are None)."""
    values = values_from_config_file(flags.pop("config_file", None))
    values.update(values_from_env(environ))
    values.update({k: v for k, v in flags.items() if v is not None})
    return validate(LaunchConfig(**values))


def processes_per_machine(config: LaunchConfig) -> int:
    total = config.num_processes
    if total is None:
        import torch

        total = torch.cuda.device_count() if config.multi_gpu else 1
    return max(1, total // config.num_machines)


def rendezvous_args(config: LaunchConfig) -> list[str]:
    if config.num_machines == 1:  # main_process_ip is ignored here, as HF does: all ranks are local
        if config.main_process_port:
            return ["--master_addr", "127.0.0.1", "--master_port", str(config.main_process_port)]
        return ["--standalone"]
    port = config.main_process_port or DEFAULT_PORT
    if config.same_network:
        return ["--master_addr", config.main_process_ip, "--master_port", str(port)]
    return ["--rdzv_backend", config.rdzv_backend, "--rdzv_endpoint", f"{config.main_process_ip}:{port}"]


def torchrun_argv(config: LaunchConfig, log_dir: str | None = None) -> list[str]:
    """torch.distributed.run's arguments; the user's script runs under accel.cli.worker to record tracebacks."""
    argv = [
        *(["--log_dir", log_dir] if log_dir else []),
        "--nnodes", str(config.num_machines),
        "--node_rank", str(config.machine_rank),
        "--nproc_per_node", str(processes_per_machine(config)),
        "--max_restarts", str(config.max_restarts),
        "--monitor_interval", str(config.monitor_interval),
        *rendezvous_args(config),
    ]  # fmt: skip
    if config.no_python:
        return [*argv, "--no_python", config.training_script, *config.training_script_args]
    target = ["-m", config.training_script] if config.module else [config.training_script]
    return [*argv, "-m", "accel.cli.worker", *target, *config.training_script_args]


def ipex_available() -> bool:
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def child_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables every rank inherits: what the Accelerator reads, plus thread and device pinning."""
    env = {
        "ACCEL_MIXED_PRECISION": config.mixed_precision,
        "ACCEL_DYNAMO_BACKEND": config.dynamo_backend,
        "ACCEL_DYNAMO_MODE": config.dynamo_mode,
        "ACCEL_DYNAMO_USE_FULLGRAPH": str(config.dynamo_use_fullgraph).lower(),
        "ACCEL_DYNAMO_USE_DYNAMIC": str(config.dynamo_use_dynamic).lower(),
        "ACCEL_DYNAMO_USE_REGIONAL_COMPILATION": str(config.dynamo_use_regional_compilation).lower(),
        "ACCEL_DEBUG_MODE": str(config.debug).lower(),
        "ACCEL_USE_CPU": str(config.use_cpu).lower(),
    }
    if config.gradient_accumulation_steps is not None:
        env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] = str(config.gradient_accumulation_steps)
    if config.ipex:
        if ipex_available():
            env["ACCEL_USE_IPEX"] = "true"
        else:
            warnings.warn("IPEX was asked for but intel_extension_for_pytorch is not installed; running without it")
    if config.gpu_ids not in ("all", "", None) and not config.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = config.gpu_ids
    threads = config.num_cpu_threads_per_process
    if threads is None and "OMP_NUM_THREADS" not in environ:
        # torchrun would force 1 thread per process; share the cores instead.
        threads = max(1, (os.cpu_count() or 1) // processes_per_machine(config))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def launch(config: LaunchConfig) -> int:
    """Runs the job through torch.distributed.run; returns the exit code (non-zero when any rank failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.update(child_env(config))
    # torchrun keeps error files and logs under a fresh /tmp/torchelastic_* per run; ours goes once we are done.
    with tempfile.TemporaryDirectory(prefix="accel-launch-") as log_dir:
        try:
            run(get_args_parser().parse_args(torchrun_argv(config, log_dir)))
        except ChildFailedError as exc:
            print(exc.format_msg(), file=sys.stderr)
            return 1
    return 0


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Adds --name and its dash spelling (--num-processes for --num_processes), as accelerate accepts both."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, dest=name, default=None, **kwargs)


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    for name, kind, text in [
        ("config_file", str, "config file (default: accel's, else HF Accelerate's default_config.yaml)"),
        ("num_processes", int, "total processes over all machines"),
        ("num_machines", int, "number of machines"),
        ("machine_rank", int, "rank of this machine, 0 .. num_machines-1"),
        ("main_process_ip", str, "address of machine_rank 0"),
        ("main_process_port", int, "port on machine_rank 0"),
        ("rdzv_backend", str, "rendezvous backend when machines are not on the same network (static, c10d)"),
        ("gpu_ids", str, "comma-separated GPU ids to use on this machine"),
        ("mixed_precision", str, f"one of {', '.join(MIXED_PRECISIONS)}"),
        ("dynamo_backend", str, "torch.compile backend (no, inductor, ...)"),
        ("dynamo_mode", str, "torch.compile mode (default, reduce-overhead, max-autotune)"),
        ("gradient_accumulation_steps", int, "steps to accumulate gradients over"),
        ("num_cpu_threads_per_process", int, "OMP threads per process (default: cores / processes)"),
        ("max_restarts", int, "restarts of the worker group before failing (default 0)"),
        ("monitor_interval", float, "seconds between checks of the workers' state (default 0.1)"),
    ]:
        add_flag(parser, name, type=kind, help=text)
    for name, text in [
        ("cpu", "train on CPU, even when GPUs are present"),
        ("multi_gpu", "one process per GPU"),
        ("same_network", "all machines are on one local network"),
        ("dynamo_use_fullgraph", "torch.compile with fullgraph=True"),
        ("dynamo_use_dynamic", "torch.compile with dynamic=True"),
        ("dynamo_use_regional_compilation", "compile repeated blocks once (regional compilation)"),
        ("debug", "check distributed operations for errors (slower)"),
        ("ipex", "use Intel PyTorch Extension on CPU"),
        ("no_python", "run training_script as an executable, not with python"),
    ]:
        add_flag(parser, name, action="store_const", const=True, help=text)
    parser.add_argument("-m", "--module", dest="module", action="store_const", const=True, default=None,
                        help="run training_script as a module, like python -m")  # fmt: skip


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    flags = {k: v for k, v in vars(args).items() if k != "run"}
    flags["use_cpu"] = flags.pop("cpu")
    flags["training_script_args"] = tuple(flags["training_script_args"])
    return flags


def run_launch(args: argparse.Namespace) -> int:
    from accel.cli.config_file import ConfigError

    try:
        config = resolve(flags_from_args(args))
    except (LaunchError, ConfigError) as exc:
        print(f"accel launch: error: {exc}", file=sys.stderr)
        return 2
    return launch(config)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch", help="run a training script on the configured processes", allow_abbrev=False
    )
    add_launch_flags(parser)
    parser.add_argument("training_script", help="the script (or module with -m) to run on every process")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=run_launch)
