"""`accelerate.commands.config`: the `accel config` parser and the config file helpers HF exposes here."""

from __future__ import annotations

import argparse
import os

from accel.cli import config as _config
from accel.cli.config_file import ClusterConfig, default_config_path, find_config_file, load_config

# HF's module constant: where `accel config` writes by default (computed once, at import, as HF's is).
default_config_file = str(default_config_path())


def load_config_from_file(config_file: str | os.PathLike | None) -> ClusterConfig:
    """The checked config in `config_file`; None reads the default one (accel's, else HF Accelerate's).

    Raises:
        accel.cli.config_file.ConfigError: the file is missing, unreadable or holds invalid values.
    """
    return load_config(config_file or find_config_file() or default_config_path())


def get_config_parser(subparsers: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """The `config` parser with its `default` and `update` subcommands, added to `subparsers` or standalone."""
    if subparsers is None:
        subparsers = argparse.ArgumentParser("accel", allow_abbrev=False).add_subparsers()
    return _config.register(subparsers)


__all__ = ["default_config_file", "get_config_parser", "load_config_from_file"]
