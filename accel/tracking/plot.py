"""`accel plot`: the logged scalars of one or more runs, one panel per metric, the runs side by side in each.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, so no global state changes in the caller's
process, and no display needed).
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterable, Sequence

from accel.tracking.runs import Run, finite_points, read_runs

PANEL_WIDTH, PANEL_HEIGHT, MAX_COLUMNS = 5.0, 3.4, 3
MIN_POINTS_TO_SMOOTH = 10  # a per-epoch metric has a handful of points: an average would only make it lag


def plot_runs(
    runs: Iterable[Run | str | os.PathLike],
    output: str | os.PathLike,
    metrics: Sequence[str] | None = None,
    smoothing: float = 0.0,
    title: str | None = None,
) -> list[str]:
    """Draws the scalars of `runs` to the image `output` (PNG, or any format matplotlib infers from the suffix).

    Args:
        runs: `Run`s, or folders / files to read them from (see `accel.tracking.runs.read_runs`).
        output: the image file to write.
        metrics: names or shell-style patterns ("eval/*") of the metrics to draw, in this order; default: all, in
            first-logged order.
        smoothing: TensorBoard's exponential moving average weight in [0, 1), for curves of at least
            MIN_POINTS_TO_SMOOTH points; the raw curve stays, faint.
        title: the figure's title.

    Returns:
        The metric names drawn.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: no metric to draw, or `smoothing` out of range.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), not {smoothing}")
    figure_class, canvas_class = _matplotlib()
    runs = list(runs)
    paths = [run for run in runs if not isinstance(run, Run)]
    loaded = [run for run in runs if isinstance(run, Run)] + (read_runs(paths) if paths else [])
    names = _metric_names(loaded, metrics)
    columns = 2 if len(names) == 4 else min(MAX_COLUMNS, len(names))
    rows = math.ceil(len(names) / columns)
    figure = figure_class(
        figsize=(PANEL_WIDTH * columns, PANEL_HEIGHT * rows + (0.4 if title else 0)), layout="constrained"
    )
    canvas_class(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for axis, name in zip(axes, names):
        _draw_panel(axis, name, loaded, smoothing)
    for axis in axes[len(names) :]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.savefig(os.fspath(output), dpi=110)
    return names


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "accel plot needs matplotlib: pip install matplotlib (or pip install 'accel[tracking]')"
        ) from error
    return Figure, FigureCanvasAgg


def _metric_names(runs: list[Run], patterns: Sequence[str] | None) -> list[str]:
    names: list[str] = []
    for run in runs:
        names.extend(name for name in run.series if name not in names and finite_points(run.series[name]))
    if patterns:  # in the order the patterns were given, then in first-logged order
        matches = [[name for name in names if fnmatch.fnmatchcase(name, pattern)] for pattern in patterns]
        names = list(dict.fromkeys(name for matched in matches for name in matched))
    if not names:
        wanted = f" matching {list(patterns)}" if patterns else ""
        found = sorted({name for run in runs for name in run.series})
        raise ValueError(f"no logged scalar{wanted} to draw in {[run.path for run in runs]} (metrics found: {found})")
    return names


def _draw_panel(axis, name: str, runs: list[Run], smoothing: float) -> None:
    drawn = 0
    for index, run in enumerate(runs):
        points = finite_points(run.series.get(name, []))
        if not points:
            continue
        steps, values = zip(*points)
        color = f"C{index % 10}"
        if smoothing and len(values) >= MIN_POINTS_TO_SMOOTH:
            axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            values = smoothed(values, smoothing)
        axis.plot(
            steps,
            values,
            color=color,
            label=run.name,
            linewidth=1.6,
            marker="o" if len(steps) < 30 else None,
            markersize=3,
        )
        drawn += 1
    axis.set_title(name)
    axis.set_xlabel("step")
    axis.grid(True, alpha=0.3)
    if len(runs) > 1 and drawn:
        axis.legend(fontsize="small")


def smoothed(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points are not pulled to 0."""
    average, result = 0.0, []
    for count, value in enumerate(values, start=1):
        average = average * weight + (1 - weight) * value
        result.append(average / (1 - weight**count))
    return result
