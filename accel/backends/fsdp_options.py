"""HF Accelerate's FSDP options as launch settings, and the one rule that runs FSDP1 options on FSDP2.

Torch-free: `accel launch`, the config file, `accel config` and `accel to-fsdp2` use it before anything heavy is
imported. Each option is a key of a config file's `fsdp_config`, an `accel launch --fsdp_*` flag of the same
name, and the FSDP_* variable HF's launcher exports to every rank, which `FullyShardedDataParallelPlugin` reads.

accel runs FSDP2 only. `to_fsdp2` turns FSDP1 options into FSDP2 ones; `accel to-fsdp2` writes its result into
a config file and `accel launch` exports it when the resolved `fsdp_version` is 1:

- The sharding strategy (`fsdp_sharding_strategy`, or a strategy name in `fsdp_reshard_after_forward`, as HF's
  questionnaire writes it) becomes `fsdp_reshard_after_forward`: FULL_SHARD and HYBRID_SHARD true, SHARD_GRAD_OP,
  HYBRID_SHARD_ZERO2 and NO_SHARD false. The strategies that need a 2-D mesh (the hybrid ones: replicate across
  machines, shard within each; NO_SHARD: replicate only) keep `fsdp_sharding_strategy` so that the runtime
  builds it. Two settings that disagree (`SHARD_GRAD_OP` and `true`) are an error naming both.
- `fsdp_backward_prefetch: BACKWARD_PRE` is what FSDP2 always does (the next all-gather is issued before each
  backward), so it goes; BACKWARD_POST and NO_PREFETCH are refused: FSDP2 cannot do either.
- `fsdp_forward_prefetch: true` is refused (HF Accelerate: not implemented for FSDP2); false goes.
- `fsdp_use_orig_params` goes (FSDP2 always uses the original parameters) and so does
  `fsdp_sync_module_states` (HF Accelerate: not needed in FSDP2); neither asks for anything FSDP2 lacks.
- `fsdp_state_dict_type` keeps FSDP1's default, FULL_STATE_DICT, when unset (FSDP2's is SHARDED_STATE_DICT), so
  checkpoints keep their format; LOCAL_STATE_DICT is refused (FSDP2 has no such state dict).
- Everything else means the same in both and is kept.

Only values that ask for something FSDP2 cannot do are refused: the defaults HF's questionnaire writes into every
FSDP1 file (`fsdp_use_orig_params: true`, `fsdp_sync_module_states: true`, `fsdp_backward_prefetch: BACKWARD_PRE`,
`fsdp_forward_prefetch: false`) all translate.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from accel.env_vars import parse_bool
from accel.unsupported import refuse

# torch's enums, in their 1-based order (HF accepts either the name or the number).
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")  # NO_PREFETCH has no number
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
FSDP2_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")  # in the order HF's questionnaire offers them
RESHARD_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
}
# Strategies FSDP2 expresses as a 2-D device mesh, for the runtime to build.
MESH_STRATEGIES = {
    "HYBRID_SHARD": "on a 2-D mesh (replicated across machines, sharded within each)",
    "HYBRID_SHARD_ZERO2": "on a 2-D mesh (replicated across machines, sharded within each)",
    "NO_SHARD": "on a replicate-only mesh (no sharding)",
}


# --- values: each parser returns the normalised value or raises ValueError saying what is allowed ---------------


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, int)):
        try:
            return parse_bool(str(value), "value")
        except ValueError:
            pass
    raise ValueError("expected true or false")


def _count(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError("expected an integer >= 0")


def _version(value: Any) -> int:
    if not isinstance(value, bool) and str(value).strip() in ("1", "2"):
        return int(value)
    raise ValueError("allowed values: 1, 2")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


def _class_names(value: Any) -> str:
    """Comma-separated class names; a list (which HF would pass on as its repr) is joined."""
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return ",".join(value)
    if isinstance(value, str):
        return value
    raise ValueError("expected comma-separated class names (or a list of them)")


def _named(names: tuple[str, ...], numbered: int = 0) -> Callable[[Any], str]:
    """A parser of `names` (any case) and, as torch's enums number them, of 1 .. `numbered`."""
    allowed = ", ".join(names) + (f" (or 1 to {numbered})" if numbered else "")

    def parse(value: Any) -> str:
        text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
        if text is not None and text.upper() in names:
            return text.upper()
        if text is not None and text.isdigit() and 1 <= int(text) <= numbered:
            return names[int(text) - 1]
        raise ValueError(f"allowed values: {allowed}")

    return parse


_strategy = _named(SHARDING_STRATEGIES, numbered=len(SHARDING_STRATEGIES))


def _reshard_after_forward(value: Any) -> bool | str:
    """FSDP2's true/false, or (FSDP1, as HF's questionnaire writes it) a sharding strategy."""
    try:
        return _boolean(value)
    except ValueError:
        pass
    try:
        return _strategy(value)
    except ValueError:
        raise ValueError(
            f"expected true or false (FSDP2), or a sharding strategy (FSDP1): {', '.join(SHARDING_STRATEGIES)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class Option:
    """One FSDP option: its config key (= launch flag dest), the variable HF's launcher exports, its parser, and
    HF's launch default (exported when the option is unset; None: exported only when set)."""

    key: str
    variable: str
    parse: Callable[[Any], Any]
    default: Any = None


OPTIONS: dict[str, Option] = {
    option.key: option
    for option in (
        Option("fsdp_version", "FSDP_VERSION", _version, 1),
        Option("fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY", _strategy, "FULL_SHARD"),
        Option("fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", _reshard_after_forward, True),
        Option("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", _boolean, False),
        Option("fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS", _count, 10**8),
        Option("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", _named(AUTO_WRAP_POLICIES)),
        Option("fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", _class_names),
        Option("fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH", _named(BACKWARD_PREFETCHES, numbered=2)),
        Option("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", _named(STATE_DICT_TYPES, numbered=3)),
        Option("fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH", _boolean, False),
        Option("fsdp_use_orig_params", "FSDP_USE_ORIG_PARAMS", _boolean, True),
        Option("fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", _boolean, True),
        Option("fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES", _boolean, True),
        Option("fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", _boolean, False),
        Option("fsdp_activation_checkpointing_offload", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", _boolean, False),
        Option("fsdp_ignored_modules", "FSDP_IGNORED_MODULES", _text),  # config file only, as in HF
    )
}
VARIABLES = tuple(option.variable for option in OPTIONS.values())
# Written by HF Accelerate before the key was renamed.
_LEGACY_KEYS = {"fsdp_backward_prefetch_policy": "fsdp_backward_prefetch"}


def option_key(name: str) -> str | None:
    """The option a `fsdp_config` key names (HF adds the `fsdp_` prefix to keys without one), or None."""
    key = name if name.startswith("fsdp") else f"fsdp_{name}"
    key = _LEGACY_KEYS.get(key, key)
    return key if key in OPTIONS else None


def unknown_key_message(name: str) -> str:
    """Why `name` is not a `fsdp_config` key: the closest one, and the allowed keys."""
    close = difflib.get_close_matches(name, list(OPTIONS), n=1)
    hint = f"unknown key (did you mean {close[0]!r}?); " if close else "unknown key; "
    return hint + "allowed keys: " + ", ".join(map(repr, OPTIONS))


def parse_entry(name: str, value: Any) -> tuple[str, Any]:
    """A `fsdp_config` entry as (option key, normalised value); a null value stays None (unset).

    Raises:
        ValueError: an unknown key or an invalid value; the message says what is allowed.
    """
    key = option_key(name)
    if key is None:
        raise ValueError(unknown_key_message(name))
    return key, None if value is None else OPTIONS[key].parse(value)


def options_of(fsdp_config: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's `fsdp_config` as options: canonical keys, normalised values, null values left out.

    Raises:
        ValueError: an unknown key or an invalid value (the message names the key).
    """
    options = {}
    for name, value in fsdp_config.items():
        try:
            key, value = parse_entry(str(name), value)
        except ValueError as error:
            raise ValueError(f"fsdp_config.{name}: {value!r} is not valid; {error}") from None
        if value is not None:
            options[key] = value
    return options


def shown(value: Any) -> str:
    """A value as HF's launcher writes it into a variable (FSDP_*, and DeepSpeed's ACCELERATE_*): booleans
    lower-case."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def environment(options: Mapping[str, Any]) -> dict[str, str]:
    """What HF's launcher exports to every rank for FSDP with `options` (normalised; unset ones left out):
    ACCELERATE_USE_FSDP, and each FSDP_* variable that is set or has a launch default."""
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, option in OPTIONS.items():
        value = options.get(key, option.default)
        if value is not None:
            env[option.variable] = shown(value)
    return env


# --- FSDP1 -> FSDP2 ------------------------------------------------------------------------------------------

_SHARDING_KEYS = ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")
_REFUSED = "FSDP1's {key} {value}"
_ACCEL_RUNS_FSDP2 = "accel runs FSDP1 options on FSDP2, which "
_PREFETCHES = (
    "always prefetches the next all-gather before each backward (BACKWARD_PRE): use BACKWARD_PRE or leave "
    "the option out."
)
_NO_EQUIVALENT = {
    ("fsdp_backward_prefetch", "BACKWARD_POST"): _PREFETCHES,
    ("fsdp_backward_prefetch", "NO_PREFETCH"): _PREFETCHES,
    ("fsdp_forward_prefetch", True): "has no forward prefetching (HF Accelerate does not implement it for FSDP2): "
    "set it to false.",
    ("fsdp_state_dict_type", "LOCAL_STATE_DICT"): "saves FULL_STATE_DICT or SHARDED_STATE_DICT: use one of them.",
}
# FSDP1-only options FSDP2 does not need, and what becomes of them (None: nothing worth saying).
_DROPPED = {
    ("fsdp_backward_prefetch", "BACKWARD_PRE"): "FSDP2's own prefetching (the next all-gather before each backward)",
    ("fsdp_forward_prefetch", False): None,
    ("fsdp_use_orig_params", True): None,
    ("fsdp_use_orig_params", False): "FSDP2 always uses the original parameters",
    ("fsdp_sync_module_states", True): None,
    ("fsdp_sync_module_states", False): None,
}


def fsdp2_refusal(key: str, value: Any) -> str | None:
    """Why FSDP2 cannot do what FSDP1's option `key` set to `value` (normalised) asks for; None when it can."""
    reason = _NO_EQUIVALENT.get((key, value))
    return None if reason is None else _ACCEL_RUNS_FSDP2 + reason


@dataclasses.dataclass(frozen=True)
class Translation:
    """FSDP1 options as FSDP2 ones.

    Attributes:
        options: the FSDP2 options (normalised values; `fsdp_version` 2).
        changes: one phrase per option whose meaning was carried over differently
            ("sharding_strategy FULL_SHARD → reshard_after_forward true").
    """

    options: dict[str, Any]
    changes: tuple[str, ...]


AskedBy = Callable[[str, Any], str]  # (option key, value) -> the flag, key or variable that set it, with the value


def _default_asked_by(key: str, value: Any) -> str:
    return f"{key}: {shown(value)}"


def _strategy_of(options: Mapping[str, Any], asked_by: AskedBy) -> tuple[str, str | None]:
    """The FSDP1 sharding strategy `options` ask for, and its name as given (None: a true/false was given).

    Raises:
        ValueError: `fsdp_sharding_strategy` and `fsdp_reshard_after_forward` disagree.
    """
    strategy, reshard = options.get("fsdp_sharding_strategy"), options.get("fsdp_reshard_after_forward")
    if isinstance(reshard, str):  # HF's questionnaire writes FSDP1's strategy under this key
        if strategy is not None and strategy != reshard:
            raise ValueError(
                f"{asked_by('fsdp_sharding_strategy', strategy)} and "
                f"{asked_by('fsdp_reshard_after_forward', reshard)} disagree: give one "
                "strategy"
            )
        return reshard, reshard
    if strategy is not None:
        if reshard is not None and reshard != RESHARD_AFTER_FORWARD[strategy]:
            raise ValueError(
                f"{asked_by('fsdp_sharding_strategy', strategy)} and "
                f"{asked_by('fsdp_reshard_after_forward', reshard)} disagree: {strategy} means "
                f"reshard_after_forward {shown(RESHARD_AFTER_FORWARD[strategy])}"
            )
        return strategy, strategy
    if reshard is not None:
        return ("FULL_SHARD" if reshard else "SHARD_GRAD_OP"), None
    return "FULL_SHARD", "FULL_SHARD (FSDP1's default)"


def _sharding(options: Mapping[str, Any], asked_by: AskedBy) -> tuple[dict[str, Any], str]:
    strategy, given = _strategy_of(options, asked_by)
    reshard = RESHARD_AFTER_FORWARD[strategy]
    translated: dict[str, Any] = {"fsdp_reshard_after_forward": reshard}
    if given is None:
        return translated, f"reshard_after_forward {shown(reshard)} as given"
    phrase = f"{given} → reshard_after_forward {shown(reshard)}"
    if strategy in MESH_STRATEGIES:
        translated["fsdp_sharding_strategy"] = strategy
        phrase += f" {MESH_STRATEGIES[strategy]}"
    return translated, phrase


def to_fsdp2(options: Mapping[str, Any], asked_by: AskedBy = _default_asked_by) -> Translation:
    """FSDP1 `options` (canonical keys, normalised values, only those set) translated to FSDP2.

    Args:
        options: the FSDP1 options.
        asked_by: names where an option came from, for errors (default: `key: value`).

    Raises:
        UnsupportedFeatureError: an option asks for something FSDP2 cannot do (see the module docstring).
        ValueError: the sharding strategy and `fsdp_reshard_after_forward` disagree.
    """
    for key, value in options.items():
        reason = fsdp2_refusal(key, value)
        if reason is not None:
            raise refuse(
                _REFUSED.format(key=key.removeprefix("fsdp_"), value=shown(value)), asked_by(key, value), reason
            )
    translated, phrase = _sharding(options, asked_by)
    changes, kept = [phrase], {}
    for key, value in options.items():
        if key in ("fsdp_version", *_SHARDING_KEYS):
            continue
        if (key, value) not in _DROPPED:
            kept[key] = value
        elif _DROPPED[(key, value)]:
            changes.append(f"{key.removeprefix('fsdp_')} {shown(value)} → {_DROPPED[(key, value)]}")
    if "fsdp_state_dict_type" not in kept:
        kept["fsdp_state_dict_type"] = "FULL_STATE_DICT"
        changes.append("state_dict_type FULL_STATE_DICT (FSDP1's default; FSDP2's is SHARDED_STATE_DICT)")
    return Translation({**kept, **translated, "fsdp_version": 2}, tuple(changes))


__all__ = [
    "AUTO_WRAP_POLICIES",
    "BACKWARD_PREFETCHES",
    "FSDP2_STATE_DICT_TYPES",
    "MESH_STRATEGIES",
    "OPTIONS",
    "RESHARD_AFTER_FORWARD",
    "SHARDING_STRATEGIES",
    "STATE_DICT_TYPES",
    "Translation",
    "VARIABLES",
    "environment",
    "fsdp2_refusal",
    "option_key",
    "options_of",
    "parse_entry",
    "shown",
    "to_fsdp2",
]
