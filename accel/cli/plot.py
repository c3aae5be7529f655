"""`accel plot RUN_DIR... [-o out.png]`: draws the logged scalars of runs (loss curves side by side) to an image.

Reads the jsonl tracker's `metrics.jsonl` (and TensorBoard event files, with tensorboard installed); needs matplotlib.
No torch import, so it starts fast.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw the logged scalars of runs to an image (needs matplotlib)",
        allow_abbrev=False,
        description="Draws every logged scalar of one or more runs, one panel per metric, the runs side by side. "
        "A RUN_DIR is a run folder (metrics.jsonl from log_with='jsonl', or TensorBoard event files) or "
        "a folder holding runs, e.g. the project_dir.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, or folders holding runs")
    parser.add_argument("-o", "--output", default="runs.png", help="the image to write (default: runs.png)")
    parser.add_argument(
        "--metrics", nargs="+", metavar="NAME", help="metrics to draw, shell patterns allowed (default: all)"
    )
    parser.add_argument(
        "--smoothing", type=float, default=0.0, help="exponential moving average weight in [0, 1), as TensorBoard's"
    )
    parser.add_argument("--title", default=None, help="a title for the figure")
    parser.set_defaults(run=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from accel.tracking.plot import plot_runs
    from accel.tracking.runs import read_runs

    try:
        runs = read_runs(args.run_dirs)
        drawn = plot_runs(runs, args.output, metrics=args.metrics, smoothing=args.smoothing, title=args.title)
    except (FileNotFoundError, ValueError, ImportError) as error:
        print(f"accel plot: {error}", file=sys.stderr)
        return 1
    torn = sum(run.torn_lines for run in runs)
    note = f"; skipped {torn} incomplete line(s)" if torn else ""
    print(f"accel plot: {len(drawn)} metric(s) of {len(runs)} run(s) -> {args.output}{note}")
    return 0
