"""`accelerate.commands.merge`: the `accel merge-weights` parser and command (accel/cli/merge.py)."""

from __future__ import annotations

import argparse

from accel.cli import merge as _merge
from accel.cli.merge import merge_command


def merge_command_parser(subparsers: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """The `merge-weights` parser: added to `subparsers` (with `func=merge_command`), or standalone."""
    if subparsers is not None:
        parser = _merge.register(subparsers)
        parser.set_defaults(func=merge_command)
        return parser
    parser = argparse.ArgumentParser("accel merge-weights", description=_merge.DESCRIPTION, allow_abbrev=False)
    _merge.add_arguments(parser)
    return parser


__all__ = ["merge_command", "merge_command_parser"]
