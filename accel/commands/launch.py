"""`accelerate.commands.launch`: the `accel launch` parser and command (accel/cli/launch.py)."""

from __future__ import annotations

import argparse

from accel.cli import launch as _launch


def launch_command_parser(subparsers: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """The `launch` parser: added to `subparsers` (with `func=launch_command`), or standalone."""
    if subparsers is not None:
        parser = _launch.register(subparsers)
        parser.set_defaults(func=launch_command)
        return parser
    parser = argparse.ArgumentParser(
        "accel launch", usage=_launch.USAGE, description=_launch.DESCRIPTION, allow_abbrev=False
    )
    _launch.add_arguments(parser)
    return parser


def launch_command(args: argparse.Namespace) -> None:
    """Launches what `args` (from `launch_command_parser`) describes; SystemExit with the job's non-zero status.

    Raises:
        accel.cli.launch.LaunchError, accel.cli.config_file.ConfigError: a bad setting or config file.
        accel.unsupported.UnsupportedFeatureError: a backend accel does not run was asked for.
    """
    code = _launch.run_launch(args)
    if code:
        raise SystemExit(code)


__all__ = ["launch_command", "launch_command_parser"]
