"""`accel` / `python -m accel`: one small parser per subcommand, each in its own module."""

from __future__ import annotations

import argparse

from accel.cli import config, env, launch, test

SUBCOMMANDS = (config, env, launch, test)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a misspelt flag (--num_proc) must be an error, not a guess.
    parser = argparse.ArgumentParser("accel", description="Run PyTorch training on any device setup.", allow_abbrev=False)
    subparsers = parser.add_subparsers(title="commands", metavar="{config,env,launch,test}")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 1
    return args.run(args) or 0
