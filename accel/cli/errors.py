"""The error a subcommand raises for bad input; `accel` prints it as `accel <command>: error: ...`, exit status 2."""

from __future__ import annotations


class CommandError(ValueError):
    """Bad input to a subcommand (a setting, a path, a missing file); the message says what and what is allowed."""
