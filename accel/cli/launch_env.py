"""HF Accelerate's `accelerate.utils.launch` helpers, on top of `accel launch`'s own resolution.

`prepare_simple_launcher_cmd_env(args)` and `prepare_multi_gpu_env(args)` take the argparse Namespace of a launch
command line (HF's parser's, or `accel.commands.launch.launch_command_parser()`'s) whose values are already
resolved, and return what accel's launcher would run and export: the same LaunchConfig checks, the same child
variables. Variables are given in accel's spelling (ACCEL_*) and HF's (ACCELERATE_*), so code reading either
finds them; booleans are written "true"/"false" (HF writes "True"/"False"; both read the same).

Differences from HF Accelerate: no `KMP_AFFINITY`/`KMP_BLOCKTIME` (accel's launcher does not set them either);
on one machine without a port, the rendezvous goes to a free port (`args.standalone = True`) rather than 29500;
a Namespace asking for Megatron-LM, TPUs, mpirun or FP8 is refused with UnsupportedFeatureError, as
`accel launch` refuses it. The TPU and SageMaker helpers always refuse.
`prepare_deepspeed_cmd_env` returns what HF's returns for its torch.distributed.run path (HF's
`deepspeed_multinode_launcher standard`, and one machine): no command (None), torchrun's names set on `args`, and
the environment; an unset launcher means standard (HF: pdsh), and with several machines another launcher or a
pdsh-only option is refused, as `accel launch` refuses it.
With `use_fsdp`, the FSDP variables are `accel launch`'s (HF's, fsdp_version 1 options as their FSDP2
translation); an FSDP option holding HF's launch default counts as unset (HF's parser fills them all in), so the
sharding strategy wins over the default `fsdp_reshard_after_forward`, as in HF's FSDP1.
With `use_parallelism_config`, the PARALLELISM_CONFIG_* variables are `accel launch`'s (HF's), and its checks are
`accel launch`'s: tensor, context or sequence parallelism sizes above 1 are refused with UnsupportedFeatureError;
the config without FSDP2, or with sizes whose product is not `num_processes`, is a LaunchError.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from accel.backends import fsdp_options
from accel.cli import deepspeed_options, parallelism_options
from accel.cli.launch import LaunchConfig, child_env, dropped_variables, parse_value, torchrun_argv, validate
from accel.cli.refusals import refuse_backend

# Namespace attributes that ask for a backend accel does not run, when true.
_BACKEND_ATTRIBUTES = {
    "use_megatron_lm": "megatron_lm",
    "tpu": "tpu",
    "tpu_use_cluster": "tpu_pod",
    "mpirun_hostfile": "mpirun",
}
# torch.distributed.run's names that HF's prepare_multi_gpu_env sets on `args` for its hand-off to torchrun.
_TORCHRUN_NAMES = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "role",
    "tee",
)


def _refuse_backends(args: argparse.Namespace) -> None:
    for attribute, backend in _BACKEND_ATTRIBUTES.items():
        if getattr(args, attribute, None):
            raise refuse_backend(backend, f"args.{attribute}={getattr(args, attribute)!r}")


def config_from_namespace(args: argparse.Namespace) -> LaunchConfig:
    """The checked LaunchConfig of a resolved launch Namespace (`cpu` or `use_cpu` for the CPU).

    Raises:
        accel.cli.launch.LaunchError: a setting is invalid.
        accel.unsupported.UnsupportedFeatureError: the Namespace asks for a backend accel does not run.
    """
    _refuse_backends(args)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(LaunchConfig):
        value = getattr(args, field.name, None)
        if value is not None and field.name not in ("training_script_args", "deepspeed_fields_from_accelerate_config"):
            values[field.name] = parse_value(field.name, value, f"args.{field.name}")
    for key, option in fsdp_options.OPTIONS.items():
        if key in values and values[key] == option.default:
            del values[key]
    values["use_cpu"] = bool(getattr(args, "cpu", False) or getattr(args, "use_cpu", False))
    values["training_script_args"] = tuple(getattr(args, "training_script_args", None) or ())
    # HF's launch_command sets it as "key1,key2" before its DeepSpeed launcher runs.
    fields = str(getattr(args, "deepspeed_fields_from_accelerate_config", None) or "")
    values["deepspeed_fields_from_accelerate_config"] = tuple(field for field in fields.split(",") if field)
    named = ("mixed_precision", "use_deepspeed", "use_fsdp", "use_parallelism_config", "num_processes")
    options = (*fsdp_options.OPTIONS, *deepspeed_options.OPTIONS, *parallelism_options.OPTIONS)
    origins = {key: f"args.{key}" for key in (*named, *options)}
    return validate(LaunchConfig(**values), origins)


def _with_hf_spellings(variables: dict[str, str]) -> dict[str, str]:
    mirrored = {
        f"ACCELERATE_{name[len('ACCEL_') :]}": value for name, value in variables.items() if name.startswith("ACCEL_")
    }
    return {**variables, **mirrored}


def _environment(config: LaunchConfig) -> dict[str, str]:
    env = os.environ.copy()
    launch_env = child_env(config, env)
    env.update(_with_hf_spellings(launch_env))
    for name in dropped_variables(config, launch_env):
        env.pop(name, None)
    return env


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment to run the script as one process (HF's simple launcher).

    Returns:
        `[python, (-m), script, *args]` (or the executable itself with `no_python`), and a copy of this process's
        environment with the launch settings added; MASTER_ADDR/MASTER_PORT when there are several processes.
    """
    config = config_from_namespace(args)
    cmd = [] if config.no_python else [sys.executable, *(["-m"] if config.module else [])]
    cmd += [config.training_script, *config.training_script_args]
    env = _environment(config)
    if (config.num_processes or 1) > 1 or config.num_machines > 1:
        env["MASTER_ADDR"] = config.main_process_ip or "127.0.0.1"
        env["MASTER_PORT"] = str(config.main_process_port or 29500)
    return cmd, env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment for a torch.distributed.run launch; also sets torchrun's names on `args` as HF does
    (`nproc_per_node`, `nnodes`, `node_rank`, `master_addr`/`master_port` or `rdzv_endpoint`, `standalone`, ...).
    """
    config = config_from_namespace(args)
    _set_torchrun_names(args, config)
    return _environment(config)


def _set_torchrun_names(args: argparse.Namespace, config: LaunchConfig) -> None:
    from torch.distributed.run import get_args_parser

    torch_args = get_args_parser().parse_args(torchrun_argv(config))
    for name in _TORCHRUN_NAMES:
        setattr(args, name, getattr(torch_args, name))


def prepare_deepspeed_cmd_env(args: argparse.Namespace) -> tuple[None, dict[str, str]]:
    """The environment for a DeepSpeed launch through torch.distributed.run (HF's only path on one machine, and
    its `deepspeed_multinode_launcher standard`); sets torchrun's names on `args` as `prepare_multi_gpu_env` does,
    and `args.deepspeed_multinode_launcher` to "standard" when unset.

    Returns:
        None (HF's command is None on this path: torchrun is called in-process) and a copy of this process's
        environment with HF's DeepSpeed variables (both spellings) and the other launch settings added.

    Raises:
        accel.cli.launch.LaunchError: a setting is invalid.
        accel.unsupported.UnsupportedFeatureError: several machines with another launcher or a pdsh-only option.
    """
    if getattr(args, "deepspeed_multinode_launcher", None) is None:
        args.deepspeed_multinode_launcher = deepspeed_options.STANDARD_LAUNCHER
    config = config_from_namespace(argparse.Namespace(**{**vars(args), "use_deepspeed": True}))
    _set_torchrun_names(args, config)
    return None, _environment(config)


def prepare_tpu(
    args: argparse.Namespace, current_env: dict[str, str], pod: bool = False
) -> tuple[argparse.Namespace, dict[str, str]]:
    """HF's TPU launch preparation; refused: accel does not run TPUs."""
    raise refuse_backend("tpu_pod" if pod else "tpu", f"prepare_tpu(args, current_env, pod={pod})")


def prepare_sagemager_args_inputs(sagemaker_config: Any, args: argparse.Namespace) -> tuple[dict, dict]:
    """HF's SageMaker job preparation (HF's spelling); refused: accel does not launch on SageMaker."""
    raise refuse_backend("sagemaker", "prepare_sagemager_args_inputs(sagemaker_config, args)")
