"""`accelerate.commands.estimate`: `accel estimate-memory`'s parser and steps (accel/cli/estimate.py)."""

from __future__ import annotations

import argparse

from accel.cli import estimate as _estimate
from accel.cli.estimate import create_empty_model, estimate_training_usage, gather_data
from accel.cli.estimate import render_table as create_ascii_table
from accel.cli.estimate import run_estimate as estimate_command


def estimate_command_parser(subparsers: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """The `estimate-memory` parser: added to `subparsers` (with `func=estimate_command`), or standalone."""
    if subparsers is not None:
        parser = _estimate.register(subparsers)
        parser.set_defaults(func=estimate_command)
        return parser
    parser = argparse.ArgumentParser("accel estimate-memory", description="Model size estimator.", allow_abbrev=False)
    _estimate.add_arguments(parser)
    return parser


__all__ = [
    "create_ascii_table",
    "create_empty_model",
    "estimate_command",
    "estimate_command_parser",
    "estimate_training_usage",
    "gather_data",
]
