"""Reading logged runs back: the jsonl tracker's files, and TensorBoard event files (when tensorboard is installed).

A run is a folder with `metrics.jsonl` (accel's jsonl tracker) or `events.out.tfevents.*` files (TensorBoard). A
folder given to `read_runs` may be a run or hold runs anywhere below it. Where one folder has both (a script that
logs with "all"), the jsonl file is read: it holds exactly what was logged. Torch-free.

Restarts: when a metric's step goes back (a run resumed from a checkpoint appends to the same file), the points at
that step and after it from before the restart are dropped, so each step keeps the value logged last, as
TensorBoard does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable

from accel.tracking.base import flatten_config
from accel.tracking.jsonl_tracker import CONFIG_FILE, METRICS_FILE

EVENTS_PREFIX = "events.out.tfevents."


@dataclasses.dataclass
class Run:
    """One run's scalars: `series[name]` is a list of (step, value) in step order.

    Attributes:
        name: a label (the folder, relative to the folder it was found in).
        path: the run's folder.
        series: metric name -> [(step, value), ...].
        config: the stored hyperparameters (jsonl runs), else {}.
        torn_lines: lines of metrics.jsonl that were not whole JSON (a run killed mid-write leaves at most one).
    """

    name: str
    path: str
    series: dict[str, list[tuple[float, float]]]
    config: dict = dataclasses.field(default_factory=dict)
    torn_lines: int = 0


def read_runs(paths: Iterable[str | os.PathLike]) -> list[Run]:
    """Every run found at or below each of `paths`, in the order given (runs within one path sorted by folder).

    Raises:
        FileNotFoundError: a path that does not exist, or holds no run.
    """
    runs: list[Run] = []
    for path in map(os.fspath, paths):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or folder")
        found = _run_folders(path)
        if not found:
            raise FileNotFoundError(
                f"{path}: no logged run here (looked for {METRICS_FILE} and {EVENTS_PREFIX}* files)"
            )
        runs.extend(_read_run(folder, kind, _label(path, folder)) for folder, kind in found)
    return runs


def _run_folders(path: str) -> list[tuple[str, str]]:
    """(folder, "jsonl" | "tensorboard") for each run at or below `path`; jsonl wins in its folder and below."""
    if os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        return [(folder, "jsonl" if os.path.basename(path) == METRICS_FILE else "tensorboard")]
    found = []
    for folder, subfolders, files in os.walk(path):
        subfolders.sort()
        if METRICS_FILE in files:
            found.append((folder, "jsonl"))
            subfolders.clear()  # TensorBoard's files of the same run are below or beside it
        elif any(name.startswith(EVENTS_PREFIX) for name in files):
            found.append((folder, "tensorboard"))
    return found


def _label(given: str, folder: str) -> str:
    given = given if os.path.isdir(given) else os.path.dirname(given) or "."
    base = os.path.basename(os.path.normpath(os.path.abspath(given)))
    relative = os.path.relpath(folder, given)
    return base if relative == "." else os.path.join(base, relative)


def _read_run(folder: str, kind: str, name: str) -> Run:
    if kind == "jsonl":
        return _read_jsonl_run(folder, name)
    return Run(name, folder, _read_event_series(folder))


# --- jsonl ---------------------------------------------------------------------------------------------------------


def _read_jsonl_run(folder: str, name: str) -> Run:
    series: dict[str, list[tuple[float, float]]] = {}
    torn = 0
    next_step = 0.0
    with open(os.path.join(folder, METRICS_FILE), encoding="utf-8", errors="replace") as f:
        for line in f:
            record = _parse(line)
            if record is None:
                torn += bool(line.strip())
                continue
            step = record.get("step")
            step = next_step if step is None else float(step)  # no step given: one after the last
            next_step = step + 1
            for metric, value in flatten_config(record.get("values") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    _append(series.setdefault(metric, []), step, float(value))
    return Run(name, folder, series, _read_config(folder), torn)


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _read_config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _append(points: list[tuple[float, float]], step: float, value: float) -> None:
    """Adds (step, value); a step at or before the last one restarts the series from there (a resumed run)."""
    while points and points[-1][0] >= step:
        points.pop()
    points.append((step, value))


# --- TensorBoard ---------------------------------------------------------------------------------------------------


def _read_event_series(folder: str) -> dict[str, list[tuple[float, float]]]:
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as error:
        raise ImportError(
            f"{folder} holds TensorBoard event files; reading them needs tensorboard: "
            "pip install tensorboard (or pip install 'accel[tracking]')"
        ) from error
    accumulator = event_accumulator.EventAccumulator(folder, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    series: dict[str, list[tuple[float, float]]] = {}
    for tag in accumulator.Tags()["scalars"]:
        points = series.setdefault(tag, [])
        for event in accumulator.Scalars(tag):
            _append(points, float(event.step), float(event.value))
    return series


def finite_points(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points whose value is a finite number (NaN and infinities break a plot's scale)."""
    return [(step, value) for step, value in points if math.isfinite(value)]
