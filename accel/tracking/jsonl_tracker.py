"""accel's own tracker: one JSON line per `log` call, no dependency, readable by `accel plot`.

Layout of a run, `<logging_dir>/<project_name>/`:
    metrics.jsonl   one line per `log` call: {"step": 3, "time": 1733000000.5, "values": {"loss": 0.25}}
    config.json     the hyperparameters `init_trackers(config=...)` stored

Each line goes to the operating system in one `write` on a file opened for appending, so a run killed at any moment
leaves whole lines (a reader also skips a torn last line, e.g. after a full disk). A run started again in the same
folder (resumed from a checkpoint) appends; readers keep, for each step, the values logged last.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from accel.tracking.base import GeneralTracker, SkipWarner, as_number, on_main_process, plain_config

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


class JSONLTracker(GeneralTracker):
    """Writes every `log` call as one JSON line to `<logging_dir>/<run_name>/metrics.jsonl`.

    Args:
        run_name: the run's folder name under `logging_dir`.
        logging_dir: where the run's folder goes (the Accelerator passes `project_dir` / `logging_dir`).
        fsync: also force each line to disk (survives a machine crash, not only a killed process; slower).

    Numbers (numpy scalars and one-element tensors too), text, booleans and None are kept, as are dicts of them
    (nested one level per dict); anything else (images, tables) is skipped with one warning naming the key.
    NaN and infinities are written as JSON's common extension (`NaN`, `Infinity`), as Python's json reads them.
    """

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, fsync: bool = False):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.fsync = fsync
        self.fd: int | None = None
        self.skipped = SkipWarner(self.name)

    @property
    def tracker(self) -> JSONLTracker:
        return self

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.logging_dir, METRICS_FILE)

    @on_main_process
    def start(self) -> None:
        os.makedirs(self.logging_dir, exist_ok=True)
        self.fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Writes `config.json` (flattened, plain values) atomically: a temporary file renamed over it."""
        # Here, not at the top: importing accel.checkpoint imports torch, and `accel plot` reads runs without it.
        from accel.checkpoint.atomic_files import fsync_directory, temporary_name

        text = json.dumps(plain_config(values), indent=2, sort_keys=True)
        path = os.path.join(self.logging_dir, CONFIG_FILE)
        temporary = temporary_name(path)
        with open(temporary, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        fsync_directory(self.logging_dir)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Appends one line: `step` (None when not given), the wall time and the loggable `values`."""
        if self.fd is None:
            raise RuntimeError("JSONLTracker.log before start(): call Accelerator.init_trackers first")
        record = {"step": step, "time": time.time(), "values": self._loggable(values, prefix="")}
        line = json.dumps(record, allow_nan=True) + "\n"
        data = line.encode()
        while data:  # a regular file takes it in one write; the loop only covers a short write (full disk)
            data = data[os.write(self.fd, data) :]
        if self.fsync:
            os.fsync(self.fd)

    def _loggable(self, values: dict, prefix: str) -> dict[str, Any]:
        kept: dict[str, Any] = {}
        for key, value in values.items():
            key = str(key)
            number = as_number(value)
            if number is not None:
                kept[key] = number
            elif value is None or isinstance(value, str):
                kept[key] = value
            elif isinstance(value, dict):
                kept[key] = self._loggable(value, prefix=f"{prefix}{key}/")
            else:
                self.skipped.skip(prefix + key, value, "numbers, text, booleans or dicts of them")
        return kept

    @on_main_process
    def finish(self) -> None:
        if self.fd is None:
            return
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
