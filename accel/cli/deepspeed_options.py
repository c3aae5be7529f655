"""HF Accelerate's DeepSpeed launch options: one table for the `accel launch` flags, the config file's
`deepspeed_config` keys and the variables HF's launcher exports to every rank for them.

Torch-free: `accel launch`, the config file and `accel config` use it before anything heavy is imported. Each
option is a key of a config file's `deepspeed_config`, an `accel launch` flag of the same name and, for those the
ranks read, the ACCELERATE_<variable> HF's launcher exports (which `DeepSpeedPlugin` reads, as ACCEL_<variable>
too). The multi-node options (`deepspeed_multinode_launcher`, the hostfile and its filters) only choose how HF
starts the machines and reach no rank.

accel always starts the ranks through torch.distributed.run: on one machine, or with `accel launch --num_machines N
--machine_rank R` on each machine, which is HF's `deepspeed_multinode_launcher: standard`. With several machines,
another launcher (pdsh, openmpi, ...) and the options only pdsh reads are refused (`multinode_refusal`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from accel.backends.fsdp_options import shown
from accel.env_vars import parse_bool

# HF's DEEPSPEED_MULTINODE_LAUNCHERS, in its order (its questionnaire offers them so; HF's default is the first).
MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")
STANDARD_LAUNCHER = "standard"
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# Read only by DeepSpeed's own runner (`deepspeed --hostfile ... --include/--exclude`), which accel never starts.
PDSH_ONLY = ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter")


# --- values: each parser returns the normalised value or raises ValueError saying what is allowed ---------------


def _stage(value: Any) -> int:
    if not isinstance(value, bool) and str(value).strip() in {str(stage) for stage in ZERO_STAGES}:
        return int(value)
    raise ValueError("allowed values: 0, 1, 2, 3")


def _device(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in OFFLOAD_DEVICES:
        return value.strip().lower()
    raise ValueError("allowed values: " + ", ".join(OFFLOAD_DEVICES))


def _steps(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer >= 1")
    text = str(value).strip() if isinstance(value, (int, str)) else ""
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError("expected an integer >= 1")


def _clipping(value: Any) -> float:
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            clipping = float(value)
        except ValueError:
            pass
        else:
            if clipping >= 0:
                return clipping
    raise ValueError("expected a number >= 0")


def parse_boolean(value: Any) -> bool:
    """A true/false word or a bool (the option tables' parser; parallelism_options uses it too)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return parse_bool(value, "value")
        except ValueError:
            pass
    raise ValueError("expected true or false")


def _text(value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError("expected a non-empty string")


def _class_names(value: Any) -> str:
    """Comma-separated class names; a list (which HF would pass on as its repr) is joined."""
    if isinstance(value, list) and value and all(isinstance(name, str) for name in value):
        return ",".join(value)
    return _text(value)


def _launcher(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in MULTINODE_LAUNCHERS:
        return value.strip().lower()
    raise ValueError("allowed values: " + ", ".join(MULTINODE_LAUNCHERS))


@dataclasses.dataclass(frozen=True)
class Option:
    """One DeepSpeed option: its config key (= launch flag dest = LaunchConfig field), the variable HF's launcher
    exports for it without the ACCELERATE_ prefix (None: it reaches no rank), and its parser."""

    key: str
    variable: str | None
    parse: Callable[[Any], Any]


OPTIONS: dict[str, Option] = {
    option.key: option
    for option in (
        Option("deepspeed_config_file", "DEEPSPEED_CONFIG_FILE", _text),
        Option("zero_stage", "DEEPSPEED_ZERO_STAGE", _stage),
        Option("offload_optimizer_device", "DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", _device),
        Option("offload_param_device", "DEEPSPEED_OFFLOAD_PARAM_DEVICE", _device),
        # HF's launcher parses these two but never exports them; accel does, for DeepSpeedPlugin reads them.
        Option("offload_optimizer_nvme_path", "DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", _text),
        Option("offload_param_nvme_path", "DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", _text),
        Option("gradient_accumulation_steps", "GRADIENT_ACCUMULATION_STEPS", _steps),
        Option("gradient_clipping", "GRADIENT_CLIPPING", _clipping),
        Option("zero3_init_flag", "DEEPSPEED_ZERO3_INIT", parse_boolean),
        Option("zero3_save_16bit_model", "DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", parse_boolean),
        Option("deepspeed_moe_layer_cls_names", "DEEPSPEED_MOE_LAYER_CLS_NAMES", _class_names),
        Option("deepspeed_multinode_launcher", None, _launcher),
        Option("deepspeed_hostfile", None, _text),
        Option("deepspeed_exclusion_filter", None, _text),
        Option("deepspeed_inclusion_filter", None, _text),
    )
}
# The options only DeepSpeed reads; gradient_accumulation_steps is also every launch's own setting.
DEEPSPEED_ONLY = tuple(key for key in OPTIONS if key != "gradient_accumulation_steps")


def parse_entry(name: str, value: Any) -> Any:
    """A `deepspeed_config` entry's normalised value; a null value stays None (unset).

    Raises:
        ValueError: an unknown key (with the closest one) or an invalid value; the message says what is allowed.
    """
    if name not in OPTIONS:
        close = difflib.get_close_matches(name, list(OPTIONS), n=1)
        hint = f"unknown key (did you mean {close[0]!r}?); " if close else "unknown key; "
        raise ValueError(hint + "allowed keys: " + ", ".join(map(repr, OPTIONS)))
    return None if value is None else OPTIONS[name].parse(value)


def environment(options: Mapping[str, Any], config_fields: tuple[str, ...]) -> dict[str, str]:
    """What HF's launcher exports to every rank for DeepSpeed with `options` (normalised; unset ones left out),
    under its ACCELERATE_ names: ACCELERATE_USE_DEEPSPEED, ACCELERATE_CONFIG_DS_FIELDS (`config_fields`, the
    settings the config file gave, which DeepSpeedPlugin refuses beside a `deepspeed_config_file`) and each option
    that is set."""
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": ",".join(config_fields).lower()}
    for key, option in OPTIONS.items():
        if option.variable is not None and options.get(key) is not None:
            env[f"ACCELERATE_{option.variable}"] = shown(options[key])
    return env


def multinode_refusal(options: Mapping[str, Any]) -> str | None:
    """With several machines: the first option (key) asking for a start accel does not do (a launcher other than
    `standard`, or a pdsh-only option), or None. Unset, the launcher is accel's own: standard."""
    if options.get("deepspeed_multinode_launcher") not in (None, STANDARD_LAUNCHER):
        return "deepspeed_multinode_launcher"
    return next((key for key in PDSH_ONLY if options.get(key) is not None), None)
