"""HF Accelerate's parallelism-config launch options: one table for the `accel launch --parallelism_config_*`
flags, the config file's `parallelism_config` keys and the PARALLELISM_CONFIG_* variables HF's launcher exports
to every rank, which `ParallelismConfig` reads there.

Torch-free: `accel launch`, the config file and `accel config` use it before anything heavy is imported. Each
option's key is a `parallelism_config` key, the flag of the same name and a LaunchConfig field.

accel runs data parallelism only: replicas (`dp_replicate_size`) and, under FSDP2, shards (`dp_shard_size`; both:
HSDP). `UNSUPPORTED_SIZES` are the sizes `accel launch` refuses above 1 (`unsupported`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

from accel.cli.deepspeed_options import parse_boolean

PREFIX = "parallelism_config_"
CP_COMM_STRATEGIES = ("allgather", "alltoall")


# --- values: each parser returns the normalised value or raises ValueError saying what is allowed ---------------


def _size(value: Any) -> int:
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError("expected an integer >= 1")


def _one_of(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and value.strip().lower() in allowed:
            return value.strip().lower()
        raise ValueError("allowed values: " + ", ".join(allowed))

    return parse


def _text(value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError("expected a non-empty string")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: its key, the variable HF's launcher exports, its parser, HF's launch default (exported when
    unset) and the size that must be above 1 for HF to export it at all (None: always exported)."""

    key: str
    variable: str
    parse: Callable[[Any], Any]
    default: Any
    exported_when: str | None = None


def _option(name: str, parse: Callable[[Any], Any], default: Any, exported_when: str | None = None) -> Option:
    return Option(PREFIX + name, "PARALLELISM_CONFIG_" + name.upper(), parse, default, exported_when)


# HF's order (its launcher's flags and its exports).
OPTIONS: dict[str, Option] = {
    option.key: option
    for option in (
        _option("dp_replicate_size", _size, 1),
        _option("dp_shard_size", _size, 1),
        _option("tp_size", _size, 1),
        _option("cp_size", _size, 1),
        _option("cp_backend", _one_of("torch"), "torch"),
        _option("cp_comm_strategy", _one_of(*CP_COMM_STRATEGIES), "allgather", PREFIX + "cp_size"),
        _option("sp_size", _size, 1),
        _option("sp_backend", _one_of("deepspeed"), "deepspeed"),
        _option("sp_seq_length", _size, None, PREFIX + "sp_size"),
        _option("sp_seq_length_is_variable", parse_boolean, True, PREFIX + "sp_size"),
        _option("sp_attn_implementation", _text, "sdpa", PREFIX + "sp_size"),
    )
}
VARIABLES = tuple(option.variable for option in OPTIONS.values())
SIZES = tuple(PREFIX + name for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"))
UNSUPPORTED_SIZES = {
    PREFIX + "tp_size": "tensor parallelism",
    PREFIX + "cp_size": "context parallelism",
    PREFIX + "sp_size": "sequence parallelism",
}


def parse_entry(name: str, value: Any) -> Any:
    """A `parallelism_config` entry's normalised value; a null value stays None (unset).

    Raises:
        ValueError: an unknown key (with the closest one) or an invalid value; the message says what is allowed.
    """
    if name not in OPTIONS:
        # HF reads only the prefixed keys (its questionnaire writes them); a bare `tp_size` would do nothing there.
        close = [PREFIX + name] if PREFIX + name in OPTIONS else difflib.get_close_matches(name, list(OPTIONS), n=1)
        hint = f"unknown key (did you mean {close[0]!r}?); " if close else "unknown key; "
        raise ValueError(hint + "allowed keys: " + ", ".join(map(repr, OPTIONS)))
    return None if value is None else OPTIONS[name].parse(value)


def _value(options: Mapping[str, Any], key: str) -> Any:
    value = options.get(key)
    return OPTIONS[key].default if value is None else value


def total_size(options: Mapping[str, Any]) -> int:
    """dp_replicate × dp_shard × tp × cp × sp, unset sizes taking HF's default of 1: the processes it needs."""
    return math.prod(_value(options, key) for key in SIZES)


def unsupported(options: Mapping[str, Any]) -> str | None:
    """The first size (key) above 1 that asks for more than data parallelism, or None."""
    return next((key for key in UNSUPPORTED_SIZES if _value(options, key) > 1), None)


def environment(options: Mapping[str, Any]) -> dict[str, str]:
    """What HF's launcher exports to every rank with `options` (normalised; unset ones take HF's launch defaults):
    ACCELERATE_USE_PARALLELISM_CONFIG, the sizes and backends always, the context-parallel strategy only with
    cp_size > 1 and the sequence-parallel settings only with sp_size > 1, each written as HF writes it (str())."""
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    for key, option in OPTIONS.items():
        if option.exported_when is None or _value(options, option.exported_when) > 1:
            env[option.variable] = str(_value(options, key))
    return env
