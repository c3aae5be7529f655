"""Reads accel's settings from the environment.

`accel launch` exports ACCEL_* variables to its children. The ACCELERATE_* spelling that HF Accelerate's
launcher exports is read too, so a script started by `accelerate launch` behaves the same.
"""

from __future__ import annotations

import os

MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def get_setting(name: str, default: str | None = None) -> str | None:
    """The value of ACCEL_<name>, else ACCELERATE_<name>, else `default`."""
    for prefix in ("ACCEL_", "ACCELERATE_"):
        value = os.environ.get(prefix + name)
        if value is not None:
            return value
    return default


def parse_bool(value: str, source: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); raises ValueError naming `source` otherwise."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{source}: {value!r} is not a boolean (use one of {', '.join(_TRUE + _FALSE)})")


def get_flag(name: str, default: bool = False) -> bool:
    """A boolean setting; an empty value means `default`."""
    value = get_setting(name)
    if value is None or not value.strip():
        return default
    return parse_bool(value, f"ACCEL_{name}")
