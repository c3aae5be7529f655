"""Refusing, at `Accelerator(...)`, every request for a backend accel does not run: one clear error, before any state.

Arguments are checked first (in the order of `Accelerator`'s signature), then the environment variables
`accel launch` / `accelerate launch` export (ACCEL_* or ACCELERATE_*).
"""

from __future__ import annotations

import os
from typing import Any

from accel.backends import DDP_INSTEAD
from accel.backends.fp8 import INSTEAD as FP8_INSTEAD
from accel.backends.fp8 import RECIPE_HANDLERS
from accel.backends.parallelism import ParallelismConfig, refuse_unsupported_parallelism
from accel.env_vars import get_flag, get_setting
from accel.unsupported import refuse

# ACCEL_USE_<name> / ACCELERATE_USE_<name> -> the feature it asks for.
_ENV_BACKENDS = {"MEGATRON_LM": "Megatron-LM"}


def _set_variable(name: str) -> str:
    """The spelling of setting `name` that is set (ACCEL_ wins over ACCELERATE_, as `get_setting` reads them)."""
    return next((prefix + name for prefix in ("ACCEL_", "ACCELERATE_") if prefix + name in os.environ), "ACCEL_" + name)


def refuse_unsupported_arguments(
    deepspeed_plugin: Any = None,
    deepspeed_plugins: Any = None,
    fsdp_plugin: Any = None,
    megatron_lm_plugin: Any = None,
    torch_tp_plugin: Any = None,
    parallelism_config: ParallelismConfig | None = None,
    mixed_precision: Any = None,
    kwargs_handlers: Any = None,
) -> None:
    """Raises `UnsupportedFeatureError` for the first argument that asks for a backend accel does not run."""
    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ValueError("You cannot pass in both `deepspeed_plugins` and `deepspeed_plugin`.")
    plugins = [
        (
            "torch_tp_plugin",
            torch_tp_plugin if getattr(torch_tp_plugin, "tp_size", 1) > 1 else None,
            "tensor parallelism",
        ),
        ("megatron_lm_plugin", megatron_lm_plugin, "Megatron-LM"),
    ]
    for argument, value, feature in plugins:
        if value is not None:
            raise refuse(feature, f"Accelerator({argument}={type(value).__name__}(...))", DDP_INSTEAD)
    if parallelism_config is not None:
        sharded = fsdp_plugin is not None or get_flag("USE_FSDP")
        refuse_unsupported_parallelism(parallelism_config, "Accelerator(parallelism_config=...)", sharded)
    if mixed_precision is not None and str(mixed_precision).lower() == "fp8":
        raise refuse("FP8 training", "Accelerator(mixed_precision='fp8')", FP8_INSTEAD)
    for handler in kwargs_handlers or ():
        if type(handler) in RECIPE_HANDLERS:
            raise refuse("FP8 training", f"Accelerator(kwargs_handlers=[{type(handler).__name__}(...)])", FP8_INSTEAD)


def refuse_unsupported_environment(mixed_precision_given: bool = False) -> None:
    """Raises `UnsupportedFeatureError` when a launcher's variables ask for a backend accel does not run.

    Args:
        mixed_precision_given: The caller passed `mixed_precision`, so ACCEL_MIXED_PRECISION is not read.
    """
    for name, feature in _ENV_BACKENDS.items():
        if get_flag("USE_" + name):
            raise refuse(feature, f"the environment variable {_set_variable('USE_' + name)}", DDP_INSTEAD)
    if not mixed_precision_given and str(get_setting("MIXED_PRECISION", "no")).strip().lower() == "fp8":
        raise refuse("FP8 training", f"the environment variable {_set_variable('MIXED_PRECISION')}=fp8", FP8_INSTEAD)
    device = get_setting("TORCH_DEVICE")
    if device is not None and device.strip().lower().startswith("xla"):
        raise refuse("TPU/XLA", f"the environment variable {_set_variable('TORCH_DEVICE')}={device}", DDP_INSTEAD)


def parallelism_config_from_environment() -> ParallelismConfig | None:
    """The `ParallelismConfig` ACCELERATE_USE_PARALLELISM_CONFIG asks for (sizes from PARALLELISM_CONFIG_*),
    refused unless it is plain data parallelism; None when the variable is not set."""
    if not get_flag("USE_PARALLELISM_CONFIG"):
        return None
    config = ParallelismConfig()
    refuse_unsupported_parallelism(
        config, f"the environment variable {_set_variable('USE_PARALLELISM_CONFIG')}", sharded=get_flag("USE_FSDP")
    )
    return config


__all__ = ["parallelism_config_from_environment", "refuse_unsupported_arguments", "refuse_unsupported_environment"]
