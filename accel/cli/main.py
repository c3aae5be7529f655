"""`accel` / `python -m accel`: one small parser per subcommand, each in its own module.

Errors are reported the same way for every subcommand: an unknown option gets argparse's message plus the
closest valid option, and bad input (CommandError, ConfigError) or a backend accel does not run
(UnsupportedFeatureError) is printed as `accel <command>: error: ...` with exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from accel.cli import config, env, estimate, launch, merge, plot, test, to_fsdp2, tpu
from accel.cli.config_file import ConfigError
from accel.cli.errors import CommandError
from accel.cli.launch_options import closest_option
from accel.unsupported import UnsupportedFeatureError

SUBCOMMANDS = (config, env, launch, test, estimate, merge, to_fsdp2, tpu, plot)
_USAGE_ERRORS = (CommandError, ConfigError, UnsupportedFeatureError)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a misspelt flag (--num_proc) must be an error, not a guess.
    parser = argparse.ArgumentParser(
        "accel", description="Run PyTorch training on any device setup.", allow_abbrev=False
    )
    subparsers = parser.add_subparsers(title="commands")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    for command in subparsers.choices.values():
        command.set_defaults(command_parser=command)
    subparsers.metavar = "{" + ",".join(subparsers.choices) + "}"
    return parser


def _unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message, each unknown option followed by the closest valid one."""
    shown = []
    for extra in extras:
        close = closest_option(extra, parser) if extra.startswith("-") else None
        shown.append(f"{extra} (did you mean {close}?)" if close else extra)
    return f"unrecognized arguments: {' '.join(shown)}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    command = getattr(args, "command_parser", parser)
    if extras:
        command.error(_unrecognized(extras, command))
    if not hasattr(args, "run"):
        parser.print_help()
        return 1
    try:
        return args.run(args) or 0
    except _USAGE_ERRORS as error:
        print(f"{command.prog}: error: {error}", file=sys.stderr)
        return 2
