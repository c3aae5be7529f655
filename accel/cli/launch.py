"""`accel launch`: resolve the launch settings once, then hand off to torch.distributed.run.

Settings come in layers, each overriding the one before: LaunchConfig's defaults (HF Accelerate's) < the config
file (`--config_file`, else the default one, else HF Accelerate's) < Slurm's facts, under srun (`values_from_slurm`)
< a Kubernetes PyTorchJob's PET_* variables (`values_from_pytorchjob`) < ACCEL_<NAME> environment variables <
command-line flags. Process supervision, rendezvous, restarts, log files and
error files are torch's elastic agent's. The options themselves (all of `accelerate launch`'s) are listed in
launch_options.py; those of backends accel does not run are refused before anything starts.

Differences from `accelerate launch`, on purpose:
  * `--cpu --num_processes N` starts N processes (HF starts one).
  * Every launch goes through torch.distributed.run, even one process, so children always see the same env.
  * Without `--main_process_port` on one machine, a free port is picked (torchrun --standalone) instead of
    29500, so two jobs on one host do not collide.
  * `--enable_cpu_affinity` pins CPU ranks too, each to its own NUMA-aware share of the cores
    (accel/cpu_affinity.py); HF pins only GPU ranks, to their GPU's NUMA node (so does accel).
  * Ranks that train on CPUs (`--cpu`, or no CUDA device) get glibc malloc settings that keep freed buffers for
    reuse instead of faulting them in again every step (`GLIBC_TUNABLES`, accel/cli/cpu_malloc.py: 20 % of an
    FSDP2 step on CPU processes); ACCEL_CPU_MALLOC_TUNING=0 or a threshold of the user's own leaves them out. HF
    sets none.
  * `-q/--quiet` applies to every launch (HF: DeepSpeed and single-process ones): on failure only the ranks'
    own output shows, without the launcher's summary and the elastic agent's log lines.
  * Under srun, one `accel launch` per node (`srun --ntasks-per-node=1 accel launch ...`) takes the machines, its
    rank, the first machine's address, the GPUs' process count and, for several machines, the job's port from the
    SLURM_* variables (`values_from_slurm`); HF reads none of them. Likewise in a PyTorchJob's pod, from the PET_*
    variables Kubeflow sets for torchrun (`values_from_pytorchjob`).
  * `--main_training_function` (HF: TPU only) works on CPUs and GPUs: the script is imported and that
    function called. The config file's `main_training_function` key (HF writes `main` into every file) is
    read only on TPUs by HF and is ignored here as well.
  * `--tee` without `--log_dir` tees into a temporary folder removed after the run; give `--log_dir` to keep
    the files.
  * `--mixed_precision fp8`, a config file asking for Megatron-LM, TPUs or mpirun, and any of those backends'
    flags are refused with one error, exit status 2.
  * FSDP (`--use_fsdp`, `distributed_type: FSDP`, ACCEL_USE_FSDP / ACCELERATE_USE_FSDP) runs on CPU processes too
    (`--cpu --use_fsdp`; HF refuses the pair). Its options' environment layer is HF's FSDP_* variables (those the
    ranks read); `--multi_gpu` over a lower layer's FSDP runs DDP, as in HF, while `--cpu` keeps FSDP. accel runs
    FSDP2: a resolved `fsdp_version` 1 is exported as FSDP2 through `accel to-fsdp2`'s rule
    (accel/backends/fsdp_options.py), saying so in one line; an FSDP1 option FSDP2 cannot honour is refused, exit
    status 2. An `--fsdp_*` flag without FSDP is refused (HF ignores it).
  * DeepSpeed (`--use_deepspeed`, `distributed_type: DEEPSPEED` + `deepspeed_config`, ACCEL_USE_DEEPSPEED /
    ACCELERATE_USE_DEEPSPEED) exports HF's DeepSpeed variables (accel/cli/deepspeed_options.py) in HF's ACCELERATE_
    spelling and accel's ACCEL_ one, the NVMe offload paths included (HF's launcher drops them), and runs on CPU
    processes too (`--cpu --use_deepspeed`; HF refuses the pair). The ranks always start through
    torch.distributed.run, never DeepSpeed's runner: several machines each run `accel launch --num_machines N
    --machine_rank R`, which is HF's `--deepspeed_multinode_launcher standard` (also what an unset launcher means
    here; HF's default is pdsh). With several machines another launcher, `--deepspeed_hostfile` and the
    inclusion/exclusion filters are refused, exit status 2; on one machine they are ignored, as in HF. A DeepSpeed
    flag without DeepSpeed is refused (HF ignores it). As with FSDP, `--multi_gpu` or `--use_fsdp` over a lower
    layer's DeepSpeed runs DDP or FSDP, `--use_deepspeed` over a lower layer's FSDP runs DeepSpeed, and
    `--use_deepspeed` with `--use_fsdp` is an error.
  * The parallelism config (`--use_parallelism_config`, a config file's non-empty `parallelism_config`,
    ACCEL_USE_PARALLELISM_CONFIG / ACCELERATE_USE_PARALLELISM_CONFIG; its options' environment layer is HF's
    PARALLELISM_CONFIG_* variables) exports HF's variables and runs its data-parallel sizes: dp_shard_size shards
    with FSDP2, dp_replicate_size × dp_shard_size is HSDP. Refused before anything starts: tp_size, cp_size or
    sp_size above 1 (exit status 2), and, as errors, the config without FSDP2 (HF's rule, which HF checks only for
    the flags), sizes whose product is not num_processes (HF's ranks each fail on it) and a
    `--parallelism_config_*` flag without `--use_parallelism_config` (HF ignores it). As in HF, a layer choosing
    `--multi_gpu`, `--use_deepspeed` or `--use_fsdp` turns off a lower layer's parallelism config.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import tempfile
import typing
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from accel import accelerate_alias, availability, slurm
from accel.backends import fsdp_options
from accel.cli import cpu_malloc, deepspeed_options, parallelism_options, pytorchjob
from accel.cli.errors import CommandError
from accel.cli.launch_options import add_launch_options, first_refused, given_options
from accel.cli.refusals import refuse_backend
from accel.env_vars import MIXED_PRECISIONS, parse_bool

DYNAMO_KEYS = (
    "dynamo_backend",
    "dynamo_mode",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)
DEFAULT_PORT = 29500
_TEE = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")
_RDZV_CONF = re.compile(r"[^=,]+=[^=,]*(,[^=,]+=[^=,]*)*")


class LaunchError(CommandError):
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
    rdzv_conf: str = ""
    same_network: bool = False
    role: str = "default"
    tee: str = "0"
    log_dir: str | None = None
    quiet: bool = False
    mixed_precision: str = "no"
    downcast_bf16: bool = False
    dynamo_backend: str = "NO"
    dynamo_mode: str = "default"
    dynamo_use_fullgraph: bool = False
    dynamo_use_dynamic: bool = False
    dynamo_use_regional_compilation: bool = False
    gradient_accumulation_steps: int | None = None
    use_deepspeed: bool = False
    # DeepSpeed's options (accel.cli.deepspeed_options.OPTIONS), normalised; None: set nowhere.
    deepspeed_config_file: str | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    gradient_clipping: float | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    deepspeed_moe_layer_cls_names: str | None = None
    deepspeed_multinode_launcher: str | None = None
    deepspeed_hostfile: str | None = None
    deepspeed_exclusion_filter: str | None = None
    deepspeed_inclusion_filter: str | None = None
    # The config file's DeepSpeed settings (HF's name): its deepspeed_config keys, and mixed_precision when the
    # precision came from the file. DeepSpeedPlugin refuses them beside a deepspeed_config_file.
    deepspeed_fields_from_accelerate_config: tuple[str, ...] = ()
    use_fsdp: bool = False
    # FSDP's options (accel.backends.fsdp_options.OPTIONS), normalised; None: set nowhere, HF's default applies.
    fsdp_version: int | None = None
    fsdp_sharding_strategy: str | None = None
    fsdp_reshard_after_forward: bool | str | None = None
    fsdp_offload_params: bool | None = None
    fsdp_min_num_params: int | None = None
    fsdp_auto_wrap_policy: str | None = None
    fsdp_transformer_layer_cls_to_wrap: str | None = None
    fsdp_backward_prefetch: str | None = None
    fsdp_state_dict_type: str | None = None
    fsdp_forward_prefetch: bool | None = None
    fsdp_use_orig_params: bool | None = None
    fsdp_cpu_ram_efficient_loading: bool | None = None
    fsdp_sync_module_states: bool | None = None
    fsdp_activation_checkpointing: bool | None = None
    fsdp_activation_checkpointing_offload: bool | None = None
    fsdp_ignored_modules: str | None = None
    use_parallelism_config: bool = False
    # The parallelism config's options (accel.cli.parallelism_options.OPTIONS), normalised; None: set nowhere, HF's
    # launch default applies.
    parallelism_config_dp_replicate_size: int | None = None
    parallelism_config_dp_shard_size: int | None = None
    parallelism_config_tp_size: int | None = None
    parallelism_config_cp_size: int | None = None
    parallelism_config_cp_backend: str | None = None
    parallelism_config_cp_comm_strategy: str | None = None
    parallelism_config_sp_size: int | None = None
    parallelism_config_sp_backend: str | None = None
    parallelism_config_sp_seq_length: int | None = None
    parallelism_config_sp_seq_length_is_variable: bool | None = None
    parallelism_config_sp_attn_implementation: str | None = None
    debug: bool = False
    ipex: bool = False
    enable_cpu_affinity: bool = False
    num_cpu_threads_per_process: int | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    module: bool = False
    no_python: bool = False
    main_training_function: str | None = None
    as_accelerate: bool = False
    training_script: str = ""
    training_script_args: tuple[str, ...] = ()


# ACCEL_<NAME> mirrors each setting; these keep the names the children read (HF's, with ACCEL_ for ACCELERATE_;
# FSDP's options are HF's FSDP_* variables, which the ranks' FullyShardedDataParallelPlugin reads, and the
# parallelism config's HF's PARALLELISM_CONFIG_* variables, which the ranks' ParallelismConfig reads).
_DEEPSPEED_VARIABLES = {key: option.variable for key, option in deepspeed_options.OPTIONS.items() if option.variable}
ENV_NAMES = {
    "debug": "ACCEL_DEBUG_MODE",
    "ipex": "ACCEL_USE_IPEX",
    "enable_cpu_affinity": "ACCEL_CPU_AFFINITY",
    **{key: option.variable for key, option in fsdp_options.OPTIONS.items()},
    **{key: option.variable for key, option in parallelism_options.OPTIONS.items()},
    **{key: f"ACCEL_{variable}" for key, variable in _DEEPSPEED_VARIABLES.items()},
}
# Read when the ACCEL_ name is unset: the ranks read HF's names too, so the launcher must agree with them.
HF_ENV_NAMES = {
    "use_fsdp": "ACCELERATE_USE_FSDP",
    "use_deepspeed": "ACCELERATE_USE_DEEPSPEED",
    "use_parallelism_config": "ACCELERATE_USE_PARALLELISM_CONFIG",
    **{key: f"ACCELERATE_{variable}" for key, variable in _DEEPSPEED_VARIABLES.items()},
}
NOT_FROM_ENV = {
    "training_script",
    "training_script_args",
    "module",
    "no_python",
    "main_training_function",
    "deepspeed_fields_from_accelerate_config",
}


def env_name(field: str) -> str:
    return ENV_NAMES.get(field, f"ACCEL_{field.upper()}")


# The backends' option tables, each option a LaunchConfig field parsed by its own parser.
_OPTION_TABLES = (fsdp_options.OPTIONS, deepspeed_options.OPTIONS, parallelism_options.OPTIONS)


def parse_value(field: str, raw: Any, source: str) -> Any:
    """Converts a config/env/flag value to the field's type, or raises LaunchError naming `source`."""
    table = next((table for table in _OPTION_TABLES if field in table), {})
    if field in table and raw is not None:
        try:
            return table[field].parse(raw)
        except ValueError as error:
            raise LaunchError(f"{source}: {raw!r} is not valid; {error}") from None
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


# --- the layers ------------------------------------------------------------------------------------------------


def _config_file_values(cluster: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the file sets, and where in the file those not named after their key come from."""
    config = cluster.to_dict()
    if config.get("num_processes", -1) < 1:
        config.pop("num_processes", None)  # HF's -1: let the launcher decide
    distributed_type = config.get("distributed_type", "NO")
    values = {
        "use_cpu": config.get("use_cpu", False) or distributed_type == "MULTI_CPU",
        "multi_gpu": distributed_type == "MULTI_GPU",
        "use_fsdp": distributed_type == "FSDP",
        "use_deepspeed": distributed_type == "DEEPSPEED",
        "ipex": bool((config.get("ipex_config") or {}).get("ipex", False)),
        "downcast_bf16": config.get("downcast_bf16") in (True, "yes"),  # HF's questionnaire writes 'yes'/'no'
    }
    for key in (
        "gpu_ids",
        "num_processes",
        "num_machines",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "mixed_precision",
        "debug",
        "enable_cpu_affinity",
        "as_accelerate",
    ):
        if config.get(key) is not None:
            values[key] = config[key]
    for key, value in (config.get("dynamo_config") or {}).items():
        if key in DYNAMO_KEYS:
            values[key] = value
    # Read whatever distributed_type says, as HF does: `--use_fsdp` over a MULTI_GPU file uses its fsdp_config.
    names = {"use_fsdp": "distributed_type", "use_deepspeed": "distributed_type"}
    for name, value in (config.get("fsdp_config") or {}).items():
        key = fsdp_options.option_key(name)  # the loader has checked the keys
        if value is not None:
            values[key], names[key] = value, f"fsdp_config.{name}"
    deepspeed_config = config.get("deepspeed_config") or {}
    for key, value in deepspeed_config.items():  # the loader has checked the keys
        if value is not None:
            values[key], names[key] = value, f"deepspeed_config.{key}"
    values["deepspeed_fields_from_accelerate_config"] = tuple(deepspeed_config)
    parallelism_values, parallelism_names = _parallelism_config_values(config.get("parallelism_config") or {})
    return {**values, **parallelism_values}, {**names, **parallelism_names}


def _parallelism_config_values(parallelism_config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's `parallelism_config` keys (the loader has checked them) and where they come from; a non-empty
    mapping turns the parallelism config on, as in HF."""
    values = {key: value for key, value in parallelism_config.items() if value is not None}
    names = {key: f"parallelism_config.{key}" for key in values}
    if parallelism_config:
        values["use_parallelism_config"], names["use_parallelism_config"] = True, "parallelism_config"
    return values, names


def values_from_config_file(path: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The LaunchConfig fields a config file sets, keyed by field name, and where each came from."""
    from accel.cli.config_file import find_config_file, load_config

    path = path or find_config_file()
    if path is None:
        return {}, {}
    cluster = load_config(path)
    cluster.check_supported()
    values, names = _config_file_values(cluster)
    origins = {key: f"{path}: {names.get(key, key)}" for key in values}
    return {k: parse_value(k, v, origins[k]) for k, v in values.items()}, origins


def values_from_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    values, origins = {}, {}
    for field in dataclasses.fields(LaunchConfig):
        if field.name in NOT_FROM_ENV:
            continue
        for name in (env_name(field.name), HF_ENV_NAMES.get(field.name)):
            if name and environ.get(name, "") != "":
                values[field.name], origins[field.name] = parse_value(field.name, environ[name], name), name
                break
    return values, origins


def _slurm_machine_rank(environ: Mapping[str, str]) -> tuple[str, int]:
    slurm.check_one_task_per_node(environ)  # SLURM_NODEID is the machine's rank only with one launcher a node
    return slurm.node_rank(environ)


_SLURM_FACTS = {
    "num_machines": slurm.num_nodes,
    "machine_rank": _slurm_machine_rank,
    "main_process_ip": slurm.first_node,
}


def values_from_slurm(
    environ: Mapping[str, str], above: Mapping[str, Any], use_cpu: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings an srun step gives `accel launch` (`srun accel launch`, one task per node), and their variables.

    num_machines is the step's node count, machine_rank SLURM_NODEID, main_process_ip the step's first node (its
    host list expanded as Slurm writes it) and, unless the processes run on the CPU, num_processes SLURM_GPUS_ON_NODE
    per machine (Slurm says nothing about CPU processes per launcher: CPU jobs keep the launcher's default of one per
    machine, or say --num_processes). Only fields that no ACCEL_* variable or flag sets (`above`) are read. This layer
    lies above the config file: Slurm's values are facts about this very job and node, while a config file's
    machine_rank or main_process_ip, written once (often in a home folder every node shares), cannot be right on
    every node. Outside an srun step (sbatch's batch script, salloc's shell) nothing is read.

    Raises:
        LaunchError: a variable needed is missing or malformed, or srun started several launchers on a node.
    """
    if not slurm.in_srun_step(environ):
        return {}, {}
    try:
        found = {field: read(environ) for field, read in _SLURM_FACTS.items() if field not in above}
        gpus = None if use_cpu or "num_processes" in above else slurm.gpus_on_node(environ)
    except slurm.SlurmError as error:
        raise LaunchError(str(error)) from None
    values = {field: value for field, (_, value) in found.items()}
    origins = {field: name for field, (name, _) in found.items()}
    if gpus is not None:
        machines = above.get("num_machines", values.get("num_machines", 1))
        values["num_processes"], origins["num_processes"] = gpus[1] * machines, gpus[0]
    return values, origins


def values_from_pytorchjob(
    environ: Mapping[str, str], above: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings a Kubernetes PyTorchJob gives `accel launch` as its pod's command (accel.cli.pytorchjob: torchrun's
    PET_* variables, which Kubeflow sets for one launcher per pod), and their variables. Only fields that no ACCEL_*
    variable or flag sets (`above`) are read; like Slurm's, these facts about this very job and pod lie above the
    config file.

    Raises:
        LaunchError: a variable needed is missing or malformed.
    """
    if not pytorchjob.in_pytorchjob(environ):
        return {}, {}
    wanted = {"num_machines", "machine_rank", "main_process_ip", "main_process_port", "num_processes"} - set(above)
    try:
        return pytorchjob.settings(environ, wanted)
    except pytorchjob.PyTorchJobError as error:
        raise LaunchError(str(error)) from None


def _slurm_port(values: dict[str, Any], origins: dict[str, str], environ: Mapping[str, str]) -> None:
    """Several machines under srun meet on the job's port (`accel.slurm.job_port`) when no layer names one, so
    jobs sharing a node do not collide; one machine keeps picking a free port."""
    if slurm.in_srun_step(environ) and values.get("num_machines", 1) > 1 and values.get("main_process_port") is None:
        try:
            values["main_process_port"], origins["main_process_port"] = slurm.job_port(environ), "SLURM_JOB_ID"
        except slurm.SlurmError as error:
            raise LaunchError(str(error)) from None


def _merge(values: dict[str, Any], layer: dict[str, Any]) -> None:
    """Lays `layer` over `values`; a layer choosing the CPU or multi-GPU overrides a lower layer's other choice,
    and one choosing multi-GPU, DeepSpeed or FSDP turns off a lower layer's DeepSpeed, FSDP or parallelism config
    that it does not choose itself (HF: `--multi_gpu` runs DDP, `--use_fsdp` over a DeepSpeed config FSDP, and the
    config file's `parallelism_config` counts only without those flags)."""
    if layer.get("use_cpu") and layer.get("multi_gpu"):
        raise LaunchError("use_cpu (--cpu) and multi_gpu (--multi_gpu) cannot be used together")
    if layer.get("use_cpu"):
        values["multi_gpu"] = False
    if layer.get("multi_gpu"):
        values["use_cpu"] = False
    if layer.get("multi_gpu") or layer.get("use_deepspeed") or layer.get("use_fsdp"):
        values["use_deepspeed"] = layer.get("use_deepspeed", False)
        values["use_fsdp"] = layer.get("use_fsdp", False)
        values["use_parallelism_config"] = layer.get("use_parallelism_config", False)
    values.update(layer)


def _merged_use_cpu(values: dict[str, Any], *layers: dict[str, Any]) -> bool:
    merged = dict(values)
    for layer in layers:
        _merge(merged, layer)
    return bool(merged.get("use_cpu", False))


def resolve(flags: dict[str, Any], environ: Mapping[str, str] = os.environ) -> LaunchConfig:
    """Builds the one LaunchConfig: config file < Slurm (under srun) < a PyTorchJob's PET_* variables < ACCEL_* env <
    flags (flags that were not given are None).

    Raises:
        LaunchError: a setting is invalid (the message names it and where it came from).
        accel.cli.config_file.ConfigError: the config file cannot be read or holds an invalid value.
        accel.unsupported.UnsupportedFeatureError: a layer asks for a backend accel does not run.
    """
    flags = dict(flags)
    values, origins = values_from_config_file(flags.pop("config_file", None))
    env_values, env_origins = values_from_env(environ)
    flag_values = {k: v for k, v in flags.items() if v is not None}
    if "mixed_precision" in values and "mixed_precision" not in {**env_values, **flag_values}:
        # HF: a precision from the file counts as one of its DeepSpeed settings.
        values["deepspeed_fields_from_accelerate_config"] += ("mixed_precision",)
    use_cpu = _merged_use_cpu(values, env_values, flag_values)  # Slurm's layer sets no device
    slurm_values, slurm_origins = values_from_slurm(environ, {**env_values, **flag_values}, use_cpu)
    job_values, job_origins = values_from_pytorchjob(environ, {**env_values, **flag_values})
    _merge(values, slurm_values)
    _merge(values, job_values)
    _merge(values, env_values)
    _merge(values, flag_values)
    origins.update(slurm_origins)
    origins.update(job_origins)
    origins.update(env_origins)
    origins.update({k: f"--{'cpu' if k == 'use_cpu' else k}" for k in flag_values})
    _slurm_port(values, origins, environ)
    return validate(LaunchConfig(**values), origins)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LaunchError(f"{name}={value!r}: expected one of {', '.join(allowed)}")


def _check_processes(config: LaunchConfig) -> None:
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
    if config.multi_gpu and config.num_processes == 1 and config.num_machines == 1:
        raise LaunchError("multi_gpu needs at least 2 processes (num_processes=1 was given)")


def _check_torchrun_formats(config: LaunchConfig) -> None:
    if not _TEE.fullmatch(config.tee):
        raise LaunchError(
            f"tee={config.tee!r}: expected 0, 1, 2 or 3 (none, stdout, stderr, both), or per local rank as 0:1,1:2"
        )
    if config.rdzv_conf and not _RDZV_CONF.fullmatch(config.rdzv_conf):
        raise LaunchError(f"rdzv_conf={config.rdzv_conf!r}: expected key1=value1,key2=value2")
    if config.main_training_function is not None and config.no_python:
        raise LaunchError("--main_training_function calls a Python function and cannot be used with --no_python")


def _asked_by(origin: str, value: str) -> str:
    """'--mixed_precision fp8', 'ACCEL_MIXED_PRECISION=fp8' or 'FILE: mixed_precision: fp8'."""
    if origin.startswith("-"):
        return f"{origin} {value}"
    return f"{origin}: {value}" if ": " in origin else f"{origin}={value}"


def validate(config: LaunchConfig, origins: Mapping[str, str] | None = None) -> LaunchConfig:
    """Normalises and checks `config`; `origins` ({field: flag, key or variable}) names who asked for a refusal."""
    from accel.cli.config_file import DYNAMO_BACKENDS, DYNAMO_MODES

    config = dataclasses.replace(config, dynamo_backend=config.dynamo_backend.upper())
    _check_choice("mixed_precision", config.mixed_precision, MIXED_PRECISIONS)
    if config.mixed_precision == "fp8":
        raise refuse_backend("fp8", _asked_by((origins or {}).get("mixed_precision", "mixed_precision"), "fp8"))
    _check_choice("dynamo_backend", config.dynamo_backend, DYNAMO_BACKENDS)
    _check_choice("dynamo_mode", config.dynamo_mode, DYNAMO_MODES)
    _check_choice("rdzv_backend", config.rdzv_backend, ("static", "c10d", "etcd", "etcd-v2"))
    if config.module and config.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    _check_processes(config)
    _check_torchrun_formats(config)
    config = _check_deepspeed(config, origins or {})
    config = _check_fsdp(config, origins or {})
    return _check_parallelism(config, origins or {})


def _switched_off(switch: str, environ: Mapping[str, str]) -> dict[str, str]:
    """ACCEL_<switch>=false, and ACCELERATE_<switch>=false when inherited: an inherited ACCELERATE_<switch>=true
    (turned off here by a higher layer, such as --multi_gpu over FSDP) must not turn the backend on in the ranks."""
    inherited = f"ACCELERATE_{switch}"
    return {f"ACCEL_{switch}": "false", **({inherited: "false"} if inherited in environ else {})}


# --- DeepSpeed -------------------------------------------------------------------------------------------------


def _options_set(config: LaunchConfig, keys: Iterable[str]) -> dict[str, Any]:
    """The options of `keys` some layer set, by key."""
    return {key: getattr(config, key) for key in keys if getattr(config, key) is not None}


def _normalised(options: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """`options` parsed by their own parsers; a bad value is a LaunchError naming where it came from."""
    return {key: parse_value(key, value, origins.get(key, key)) for key, value in options.items()}


def _first_flag(keys: Iterable[str], origins: Mapping[str, str]) -> str | None:
    """The first of `keys` given as a command-line flag (as typed), or None."""
    return next((origins[key] for key in keys if origins.get(key, "").startswith("-")), None)


def _deepspeed_settings(config: LaunchConfig) -> dict[str, Any]:
    """The DeepSpeed options some layer set, by key."""
    return _options_set(config, deepspeed_options.OPTIONS)


def _check_deepspeed(config: LaunchConfig, origins: Mapping[str, str]) -> LaunchConfig:
    """Normalises the DeepSpeed options and refuses, before anything starts, what cannot run (see the module
    docstring)."""
    options = _normalised(_deepspeed_settings(config), origins)
    config = dataclasses.replace(config, **options)
    if config.use_deepspeed and config.use_fsdp:
        raise LaunchError(
            f"{origins.get('use_deepspeed', 'use_deepspeed')} and {origins.get('use_fsdp', 'use_fsdp')} "
            "cannot be used together: choose DeepSpeed or FSDP"
        )
    if not config.use_deepspeed:
        flag = _first_flag((key for key in deepspeed_options.DEEPSPEED_ONLY if key in options), origins)
        if flag:
            raise LaunchError(
                f"{flag} has no effect without DeepSpeed: add --use_deepspeed (or use a config file "
                "with distributed_type: DEEPSPEED)"
            )
        return config
    refused = deepspeed_options.multinode_refusal(options) if config.num_machines > 1 else None
    if refused is not None:
        asked_by = _asked_by(origins.get(refused, refused), fsdp_options.shown(options[refused]))
        raise refuse_backend("deepspeed_multinode", f"{asked_by} with num_machines={config.num_machines}")
    return config


def deepspeed_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """ACCEL_USE_DEEPSPEED, and with DeepSpeed what HF's launcher exports (deepspeed_options.environment) in its
    ACCELERATE_ spelling and accel's ACCEL_ one (the ranks read ACCEL_ first: an inherited one must not win), and
    PYTHONPATH with the working folder added, as HF adds it."""
    if not config.use_deepspeed:
        return _switched_off("USE_DEEPSPEED", environ)
    fields = config.deepspeed_fields_from_accelerate_config
    hf_names = deepspeed_options.environment(_deepspeed_settings(config), fields)
    accel_names = {f"ACCEL_{name.removeprefix('ACCELERATE_')}": value for name, value in hf_names.items()}
    paths = [path for path in environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return {**accel_names, **hf_names, "PYTHONPATH": os.pathsep.join([*paths, os.path.abspath(".")])}


# --- FSDP ------------------------------------------------------------------------------------------------------


def _fsdp_settings(config: LaunchConfig) -> dict[str, Any]:
    """The FSDP options some layer set, by key (the others take HF's launch defaults)."""
    return _options_set(config, fsdp_options.OPTIONS)


def _check_fsdp(config: LaunchConfig, origins: Mapping[str, str]) -> LaunchConfig:
    """Normalises the FSDP options and refuses, before anything starts, what cannot run (see the module docstring)."""
    options = _normalised(_fsdp_settings(config), origins)
    config = dataclasses.replace(config, **options)
    if not config.use_fsdp:
        flag = _first_flag(options, origins)
        if flag:
            raise LaunchError(
                f"{flag} has no effect without FSDP: add --use_fsdp (or use a config file with distributed_type: FSDP)"
            )
        return config
    if options.get("fsdp_cpu_ram_efficient_loading", True) and options.get("fsdp_sync_module_states") is False:
        origin = origins.get("fsdp_sync_module_states", "fsdp_sync_module_states")
        raise LaunchError(
            f"{_asked_by(origin, 'false')}: fsdp_cpu_ram_efficient_loading (true unless set to false) "
            "needs fsdp_sync_module_states true, as in HF Accelerate"
        )
    fsdp_translation(config, origins)  # FSDP1 options FSDP2 cannot honour are refused here
    return config


def fsdp_translation(config: LaunchConfig, origins: Mapping[str, str] | None = None) -> Any:
    """The FSDP2 translation (`accel.backends.fsdp_options.Translation`) of the launch's FSDP options when FSDP
    runs with fsdp_version 1; None otherwise. `origins` name who set an option refused or contradicted.

    Raises:
        LaunchError: the sharding strategy and fsdp_reshard_after_forward disagree.
        accel.unsupported.UnsupportedFeatureError: an FSDP1 option asks for what FSDP2 cannot do.
    """
    if not config.use_fsdp or (config.fsdp_version or 1) != 1:
        return None
    origins = origins or {}

    def asked_by(key: str, value: Any) -> str:
        return _asked_by(origins.get(key, key), fsdp_options.shown(value))

    try:
        translation = fsdp_options.to_fsdp2(_fsdp_settings(config), asked_by)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    return translation


def fsdp_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """ACCEL_USE_FSDP, and with FSDP what HF's launcher exports (ACCELERATE_USE_FSDP and the FSDP_* variables),
    FSDP1 options as their FSDP2 translation."""
    if not config.use_fsdp:
        return _switched_off("USE_FSDP", environ)
    translation = fsdp_translation(config)
    options = translation.options if translation is not None else _fsdp_settings(config)
    return {"ACCEL_USE_FSDP": "true", **fsdp_options.environment(options)}


def dropped_variables(config: LaunchConfig, env: Mapping[str, str]) -> list[str]:
    """The variables the ranks must not inherit, of those `env` (child_env's) leaves out: with FSDP, the FSDP_*
    ones, such as an FSDP1 option the translation dropped; always, the PARALLELISM_CONFIG_* ones (all of them
    without the parallelism config)."""
    fsdp = [name for name in fsdp_options.VARIABLES if name not in env] if config.use_fsdp else []
    return fsdp + [name for name in parallelism_options.VARIABLES if name not in env]


def fsdp_line(config: LaunchConfig) -> str | None:
    """The line saying how fsdp_version 1 options run on FSDP2; None when nothing was translated."""
    translation = fsdp_translation(config)
    if translation is None:
        return None
    return "accel launch: fsdp_version 1 options run on FSDP2: " + "; ".join(translation.changes)


# --- the parallelism config ------------------------------------------------------------------------------------


def _parallelism_settings(config: LaunchConfig) -> dict[str, Any]:
    """The parallelism config's options some layer set, by key (the others take HF's launch defaults)."""
    return _options_set(config, parallelism_options.OPTIONS)


def _check_parallelism(config: LaunchConfig, origins: Mapping[str, str]) -> LaunchConfig:
    """Normalises the parallelism config's options and refuses, before anything starts, what cannot run: sizes
    asking for more than data parallelism, the config without FSDP2 (HF's rule), and sizes whose product is not the
    number of processes (HF's ranks would each fail on it)."""
    options = _normalised(_parallelism_settings(config), origins)
    config = dataclasses.replace(config, **options)
    if not config.use_parallelism_config:
        flag = _first_flag(options, origins)
        if flag:
            raise LaunchError(f"{flag} has no effect without --use_parallelism_config")
        return config
    refused = parallelism_options.unsupported(options)
    if refused is not None:
        raise refuse_backend("parallelism_config", _asked_by(origins.get(refused, refused), str(options[refused])))
    _check_parallelism_fsdp(config, origins)
    total = parallelism_options.total_size(options)
    if config.num_processes is not None and total != config.num_processes:
        origin = origins.get("num_processes", "num_processes")
        raise LaunchError(
            f"the parallelism config's sizes (dp_replicate × dp_shard × tp × cp × sp, unset ones 1) make {total} "
            f"processes but {_asked_by(origin, str(config.num_processes))} asks for {config.num_processes}: "
            "they must be equal"
        )
    return config


def _check_parallelism_fsdp(config: LaunchConfig, origins: Mapping[str, str]) -> None:
    """HF's rule: the parallelism config needs FSDP with fsdp_version 2."""
    if config.use_fsdp and config.fsdp_version == 2:
        return
    if not config.use_fsdp:
        reason = "FSDP is off"
    elif "fsdp_version" in origins:
        reason = f"{_asked_by(origins['fsdp_version'], '1')} asks for FSDP1"
    else:
        reason = "fsdp_version is unset (HF's default: 1)"
    raise LaunchError(
        f"{origins.get('use_parallelism_config', 'use_parallelism_config')}: You cannot use "
        f"`--use_parallelism_config` without `--use_fsdp` and `--fsdp_version=2`; {reason}"
    )


def parallelism_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """ACCEL_USE_PARALLELISM_CONFIG, and with the parallelism config what HF's launcher exports
    (ACCELERATE_USE_PARALLELISM_CONFIG and the PARALLELISM_CONFIG_* variables)."""
    if not config.use_parallelism_config:
        return _switched_off("USE_PARALLELISM_CONFIG", environ)
    return {"ACCEL_USE_PARALLELISM_CONFIG": "true", **parallelism_options.environment(_parallelism_settings(config))}


# --- the hand-off to torch.distributed.run --------------------------------------------------------------------


def processes_per_machine(config: LaunchConfig) -> int:
    total = config.num_processes
    if total is None:
        import torch

        # HF: FSDP and DeepSpeed take every GPU
        on_gpus = config.multi_gpu or ((config.use_fsdp or config.use_deepspeed) and not config.use_cpu)
        total = torch.cuda.device_count() if on_gpus else 1
    return max(1, total // config.num_machines)


def rendezvous_args(config: LaunchConfig) -> list[str]:
    """How the machines meet. `same_network` needs nothing of its own: torchrun's static rendezvous at
    master_addr:master_port and HF's rdzv_endpoint of the same address are the same store."""
    if config.num_machines == 1:  # main_process_ip is ignored here, as HF does: all ranks are local
        if not config.main_process_port:
            return ["--standalone"]
        host = "127.0.0.1"
    else:
        host = config.main_process_ip
    port = config.main_process_port or DEFAULT_PORT
    if config.rdzv_backend == "static":
        return ["--master_addr", host, "--master_port", str(port)]
    return ["--rdzv_backend", config.rdzv_backend, "--rdzv_endpoint", f"{host}:{port}"]


def _worker_target(config: LaunchConfig) -> list[str]:
    """What torchrun starts per rank: accel.cli.worker (death with the launcher, tracebacks, affinity), which
    replaces itself with the executable under --no_python, once it has made sure it dies with the launcher."""
    prefix = ["--exec"] if config.no_python else []
    if config.main_training_function is not None:
        prefix = ["--call", config.main_training_function]
    target = ["-m", config.training_script] if config.module else [config.training_script]
    return ["-m", "accel.cli.worker", *prefix, *target, *config.training_script_args]


def torchrun_argv(config: LaunchConfig, log_dir: str | None = None) -> list[str]:
    """torch.distributed.run's arguments; `log_dir` is used when the config names none."""
    log_dir = config.log_dir or log_dir
    argv = [
        *(["--log_dir", log_dir] if log_dir else []),
        "--nnodes",
        str(config.num_machines),
        "--node_rank",
        str(config.machine_rank),
        "--nproc_per_node",
        str(processes_per_machine(config)),
        "--max_restarts",
        str(config.max_restarts),
        "--monitor_interval",
        str(config.monitor_interval),
        "--role",
        config.role,
        "--tee",
        config.tee,
        *(["--rdzv_conf", config.rdzv_conf] if config.rdzv_conf else []),
        *rendezvous_args(config),
    ]
    return [*argv, *_worker_target(config)]


def child_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables every rank inherits: what the Accelerator reads, plus thread, device and core pinning."""
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
    env.update(fsdp_env(config, environ))
    env.update(parallelism_env(config, environ))
    env.update(deepspeed_env(config, environ))
    if config.enable_cpu_affinity:
        env["ACCEL_CPU_AFFINITY"] = "1"
    if config.as_accelerate:
        env[accelerate_alias.ENV_VARIABLE] = "1"
    env.update(restart_env(config, environ))
    if config.downcast_bf16:
        # HF reads ACCELERATE_DOWNCAST_BF16 on TPUs only; accel runs none, so say that it changes nothing here.
        warnings.warn(
            "downcast_bf16 only affects bf16 training on TPUs (XLA), which accel does not run: it has no "
            "effect on CPUs and CUDA GPUs (as in HF Accelerate)"
        )
        env["ACCEL_DOWNCAST_BF16"] = "1"
    if config.ipex:
        if availability.is_ipex_available():
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
    env.update(cpu_malloc.malloc_env(trains_on_cpu(config), environ))
    return env


def trains_on_cpu(config: LaunchConfig) -> bool:
    import torch

    return config.use_cpu or not torch.cuda.is_available()


def restart_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """With restarts and a c10d rendezvous (one machine without a port, or `--rdzv_backend c10d`), torch's switch
    that gives each rendezvous round a store of its own, hosted by the round's rank 0 on a new port. By default the
    agents share their rendezvous store with the workers of every round, without a prefix per round, so a restarted
    worker group reads its failed predecessor's keys and hangs connecting to dead processes (pytorch#135712; on one
    machine accel.wire.process_group also separates the attempts itself). A value the user set is kept."""
    c10d = (config.num_machines == 1 and not config.main_process_port) or config.rdzv_backend == "c10d"
    if config.max_restarts > 0 and c10d and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return {}


def _silence_launcher_logs() -> None:
    """--quiet: the elastic agent's own log lines (worker exits, SIGTERMs sent) stay out of the output."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(config: LaunchConfig) -> int:
    """Runs the job through torch.distributed.run; returns the exit code (non-zero when any rank failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # ACCEL_LAUNCHER_PID: the ranks' expected parent (the elastic agent runs here); see accel.cli.worker.
    env = child_env(config)
    os.environ.update(env, ACCEL_LAUNCHER_PID=str(os.getpid()))
    for name in dropped_variables(config, env):
        os.environ.pop(name, None)
    translated = fsdp_line(config)
    if translated is not None:
        print(translated, file=sys.stderr, flush=True)
    if config.as_accelerate:
        print(
            f"accel launch: `import accelerate` resolves to accel in every rank ({accelerate_alias.describe()})",
            file=sys.stderr,
            flush=True,
        )
    if config.quiet:
        _silence_launcher_logs()
    # torchrun keeps error files and logs under a fresh /tmp/torchelastic_* per run; ours goes once we are done.
    with tempfile.TemporaryDirectory(prefix="accel-launch-") as log_dir:
        try:
            run(get_args_parser().parse_args(torchrun_argv(config, log_dir)))
        except ChildFailedError as exc:
            if not config.quiet:
                print(exc.format_msg(), file=sys.stderr)
            return 1
    return 0


# --- the command ---------------------------------------------------------------------------------------------

# LaunchConfig fields whose flag has another dest.
_FIELD_OF_DEST = {"cpu": "use_cpu"}
_CONFIG_FIELDS = {field.name for field in dataclasses.fields(LaunchConfig)}


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, keyed by LaunchConfig field (None: not given), and the script.

    Raises:
        accel.unsupported.UnsupportedFeatureError: an option of a backend accel does not run was given.
    """
    refusal = first_refused(args)
    if refusal is not None:
        raise refusal
    given = given_options(args)
    flags: dict[str, Any] = {"config_file": args.config_file}
    for dest, value in vars(args).items():
        field = _FIELD_OF_DEST.get(dest, dest)
        if field in _CONFIG_FIELDS and field not in ("training_script", "training_script_args"):
            flags[field] = value if dest in given else None
    flags["training_script"] = args.training_script
    flags["training_script_args"] = tuple(args.training_script_args)
    return flags


def run_launch(args: argparse.Namespace) -> int:
    """`accel launch`: resolve, then run. Bad settings and refusals propagate to main(), which exits with 2."""
    return launch(resolve(flags_from_args(args)))


USAGE = "accel launch [options] training_script [training_script_args ...]"
DESCRIPTION = (
    "Launch a script on several processes. Options can be spelt with underscores (--num_processes) or "
    "dashes (--num-processes)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `accelerate launch`, then the script and its arguments."""
    add_launch_options(parser)
    parser.add_argument("training_script", help="the script (or module with -m) to run on every process")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on the configured processes",
        usage=USAGE,
        description=DESCRIPTION,
        allow_abbrev=False,
    )
    add_arguments(parser)
    parser.set_defaults(run=run_launch)
    return parser
