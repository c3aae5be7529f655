"""`accel to-fsdp2 --config_file IN (--output_file OUT | --overwrite)`: an FSDP1 config file, converted to FSDP2.

HF Accelerate's conversion of the `fsdp_config` keys: renamed or kept as FSDP2 names them, FSDP1-only keys
dropped (each named in a warning), `fsdp_sharding_strategy` turned into `fsdp_reshard_after_forward`, and
`fsdp_version: 2`. A file without `fsdp_config` or already at version 2 is written unchanged. accel does not
run FSDP yet, so the converted file still refuses at `accel launch`; the command exists so that configs can be
kept up to date with accel alone.

Differences from HF Accelerate: the input is checked like every config file (errors name the file and key),
the output is written atomically and in the input's format (YAML, or JSON for a .json name).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from accel.cli.errors import CommandError

logger = logging.getLogger(__name__)

_REMOVED, _NOT_YET_IMPLEMENTED = "removed in FSDP2", "not yet implemented in FSDP2"
# FSDP1 key -> its FSDP2 key, or why it is dropped. Keys not listed are carried over unchanged.
FSDP2_KEYS: dict[str, str] = {
    "fsdp_version": "fsdp_version",
    "fsdp_reshard_after_forward": "fsdp_reshard_after_forward",
    "fsdp_auto_wrap_policy": "fsdp_auto_wrap_policy",
    "fsdp_backward_prefetch": _REMOVED,
    "fsdp_forward_prefetch": _NOT_YET_IMPLEMENTED,
    "fsdp_cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading",
    "fsdp_offload_params": "fsdp_offload_params",
    "fsdp_sharding_strategy": "fsdp_reshard_after_forward",
    "fsdp_state_dict_type": "fsdp_state_dict_type",
    "fsdp_sync_module_states": _REMOVED,
    "fsdp_transformer_layer_cls_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params": "fsdp_min_num_params",
    "fsdp_use_orig_params": _REMOVED,
    "fsdp_activation_checkpointing": "fsdp_activation_checkpointing",
}
# FSDP1 sharding strategies as FSDP2's reshard_after_forward (both keys may hold one in FSDP1 files).
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True,
                         "HYBRID_SHARD_ZERO2": False, "NO_SHARD": False}  # fmt: skip
_STRATEGY_KEYS = ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a config file's mapping) with its `fsdp_config` converted to FSDP2; a new dict."""
    fsdp_config = config.get("fsdp_config") or {}
    if not fsdp_config:
        logger.info("No FSDP config found in the config file, skipping conversion...")
        return dict(config)
    if str(fsdp_config.get("fsdp_version", 1)) == "2":
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        return dict(config)
    converted = {}
    for key, value in fsdp_config.items():
        target = FSDP2_KEYS.get(key, key)
        if target in (_REMOVED, _NOT_YET_IMPLEMENTED):
            logger.warning(f"Argument {key} is {target}, skipping this key...")
            continue
        if key in _STRATEGY_KEYS:
            value = RESHARD_AFTER_FORWARD.get(value, value)
        converted[target] = value
    converted["fsdp_version"] = 2
    return {**config, "fsdp_config": converted}


def _output_path(args: argparse.Namespace) -> Path:
    source = Path(args.config_file)
    if not source.is_file():
        raise CommandError(f"config file {source} not found")
    if args.output_file is None:
        if not args.overwrite:
            raise CommandError("give --output_file, or --overwrite to convert the config file in place")
        return source
    output = Path(args.output_file)
    if output.exists() and not args.overwrite:
        raise CommandError(f"output file {output} already exists; pass --overwrite to replace it")
    return output


def to_fsdp2_command(args: argparse.Namespace) -> int:
    from accel.cli.config_file import load_config, save_config

    output = _output_path(args)
    config = load_config(args.config_file)
    converted = convert_config_to_fsdp2({"fsdp_config": config.fsdp_config})["fsdp_config"]
    path = save_config(dataclasses.replace(config, fsdp_config=converted), output)
    print(f"FSDP2 config written to {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("to-fsdp2", help="convert a config file from FSDP1 to FSDP2",
                                   description="Convert an accel / HF Accelerate config file from FSDP1 to FSDP2.",
                                   allow_abbrev=False)  # fmt: skip
    parser.add_argument("--config_file", "--config-file", required=True, help="the config file to convert")
    parser.add_argument("--overwrite", action="store_true", default=False,
                        help="replace the output file if it exists (or the config file, without --output_file)")  # fmt: skip
    parser.add_argument("--output_file", "--output-file", default=None, help="where to write the converted config")
    parser.set_defaults(run=to_fsdp2_command)
    return parser
