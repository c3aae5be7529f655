"""`accel to-fsdp2 --config_file IN (--output_file OUT | --overwrite)`: an FSDP1 config file, converted to FSDP2.

HF Accelerate's conversion of the `fsdp_config` keys, by the rule `accel launch` applies to fsdp_version 1
(accel/backends/fsdp_options.py `to_fsdp2`): the sharding strategy becomes `fsdp_reshard_after_forward`,
FSDP1-only keys FSDP2 does not need are dropped (each translation said in a warning), and `fsdp_version: 2`.
A file without `fsdp_config` or already at version 2 is written unchanged.

Differences from HF Accelerate: the input is checked like every config file (errors name the file and key), the
output is written atomically and in the input's format (YAML, or JSON for a .json name). The conversion keeps
what FSDP1 meant: a hybrid or NO_SHARD strategy keeps `fsdp_sharding_strategy` (HF drops the mesh), an unset
`fsdp_state_dict_type` is written as FSDP1's default, FULL_STATE_DICT (HF's conversion would switch to FSDP2's
SHARDED_STATE_DICT), and a key FSDP2 cannot honour (`fsdp_backward_prefetch: BACKWARD_POST` or `NO_PREFETCH`,
`fsdp_forward_prefetch: true`, `fsdp_state_dict_type: LOCAL_STATE_DICT`) stops the conversion with exit status 2
naming it (HF drops it), as `accel launch` refuses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from accel.backends import fsdp_options
from accel.cli.errors import CommandError

logger = logging.getLogger(__name__)


def convert_config_to_fsdp2(config: dict[str, Any], source: str = "<config>") -> dict[str, Any]:
    """`config` (a config file's mapping) with its `fsdp_config` converted to FSDP2; a new dict.

    Raises:
        ValueError: an unknown `fsdp_config` key, an invalid value, or a sharding strategy and
            `fsdp_reshard_after_forward` that disagree.
        accel.unsupported.UnsupportedFeatureError: a key asks for something FSDP2 cannot do.
    """
    fsdp_config = config.get("fsdp_config") or {}
    if not fsdp_config:
        logger.info("No FSDP config found in the config file, skipping conversion...")
        return dict(config)
    options = fsdp_options.options_of(fsdp_config)
    if options.get("fsdp_version", 1) == 2:
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        return dict(config)
    names = {fsdp_options.option_key(str(name)): name for name in fsdp_config}

    def asked_by(key: str, value: Any) -> str:
        return f"{source}: fsdp_config.{names.get(key, key)}: {fsdp_options.shown(value)}"

    translation = fsdp_options.to_fsdp2(options, asked_by)
    for change in translation.changes:
        logger.warning(f"FSDP1 to FSDP2: {change}")
    return {**config, "fsdp_config": translation.options}


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
    try:
        converted = convert_config_to_fsdp2({"fsdp_config": config.fsdp_config}, args.config_file)["fsdp_config"]
    except ValueError as error:
        raise CommandError(str(error)) from None
    path = save_config(dataclasses.replace(config, fsdp_config=converted), output)
    print(f"FSDP2 config written to {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "to-fsdp2",
        help="convert a config file from FSDP1 to FSDP2",
        description="Convert an accel / HF Accelerate config file from FSDP1 to FSDP2.",
        allow_abbrev=False,
    )
    parser.add_argument("--config_file", "--config-file", required=True, help="the config file to convert")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        default=False,
        help="replace the output file if it exists (or the config file, without --output_file)",
    )
    parser.add_argument("--output_file", "--output-file", default=None, help="where to write the converted config")
    parser.set_defaults(run=to_fsdp2_command)
    return parser
