"""`accel test`: launches accel/cli/checks.py over the configured processes and reports the outcome."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CHECK_SCRIPT = Path(__file__).with_name("checks.py")


def run_test(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "accel", "launch"]
    if args.config_file:
        command += ["--config_file", args.config_file]
    result = subprocess.run([*command, str(CHECK_SCRIPT)], check=False)
    if result.returncode != 0:
        print(
            f"accel test: FAILED (exit code {result.returncode}); the failing check and rank are named above",
            file=sys.stderr,
        )
    return result.returncode


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "test", help="check that the configured setup runs distributed training", allow_abbrev=False
    )
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="config file to test (default: the default one)"
    )
    parser.set_defaults(run=run_test)
