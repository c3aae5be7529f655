"""What every benchmark report shares: reading pytest-benchmark's JSON, formatting times and ratios, markdown
tables, the machine's description, and writing OUT_DIR/<name>.md beside its plot.

Each report (gather.py, unscale.py, checkpoint.py, process_group.py, big_model.py) keeps only what is its own:
which numbers go in which column, the goals, and the text around them. Run one as a script, for instance
`python benchmarks/report/gather.py OUT_DIR results-2.json results-4.json` (the Makefile's bench-* targets do).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import Any, Callable, Iterator

MISSING = "—"


def load(paths: list[str]) -> tuple[list[tuple[str, dict]], dict]:
    """Every benchmark of the JSON files `paths` as (its group, its extra_info), and the machine they ran on."""
    benchmarks, machine = [], {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        machine = data.get("machine_info", machine)
        benchmarks += [(bench.get("group") or "", bench["extra_info"]) for bench in data["benchmarks"]]
    return benchmarks, machine


def cpu_name(machine: dict) -> str:
    return machine.get("cpu", {}).get("brand_raw", "an unknown CPU")


def cpu_count(machine: dict) -> str:
    return str(machine.get("cpu", {}).get("count", "?"))


def row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def table(header: list[str], rows: list[str]) -> list[str]:
    """A markdown table: the header row, the rule under it, then `rows` (made with `row`)."""
    return [row(*header), "|" + "---|" * len(header), *rows]


def time_in(seconds: float | None, unit: float, digits: int = 1) -> str:
    """`seconds` times `unit` (1e6: µs, 1e3: ms) with thousands separators, or MISSING."""
    return MISSING if seconds is None else f"{seconds * unit:,.{digits}f}"


def quartile_ratio(ratio: dict | None, digits: int = 1) -> str:
    """A ratio measured per round: "median× (q1–q3)", the quartiles being the run-to-run spread."""
    if ratio is None:
        return MISSING
    return f"{ratio['median']:.{digits}f}× ({ratio['q1']:.{digits}f}–{ratio['q3']:.{digits}f})"


def per_round_ratio(slower: list[float] | None, faster: list[float] | None, method: str = "exclusive") -> dict | None:
    """The median and quartiles of slower/faster over rounds in which both were measured, or None. `method`: as
    `statistics.quantiles` ("inclusive" keeps the quartiles of a few rounds within the values measured)."""
    if not slower or not faster:
        return None
    pairs = sorted(a / b for a, b in zip(slower, faster))
    q1, _, q3 = statistics.quantiles(pairs, n=4, method=method) if len(pairs) > 1 else (pairs[0],) * 3
    return {"median": statistics.median(pairs), "q1": q1, "q3": q3}


def at_least(goal: float, value: float) -> str:
    """ "≥ goal× met" or "≥ goal× NOT met"."""
    return f"≥ {goal}× {'met' if value >= goal else 'NOT met'}"


def at_most(goal: float, value: float, unit: str = "×") -> str:
    """ "≤ goal<unit> met" or "≤ goal<unit> NOT met" (unit "×" for a ratio, " µs" for a time in µs...)."""
    return f"≤ {goal}{unit} {'met' if value <= goal else 'NOT met'}"


def rank_spread(info: dict) -> str:
    """The slowest rank's median over the fastest's (`per_rank_accel_median_s`): 1.0 when no rank waits on a
    starved peer more than the others."""
    per_rank = info.get("per_rank_accel_median_s")
    return MISSING if not per_rank else f"{max(per_rank) / min(per_rank):.2f}"


def by_world_and_payload(results: dict, payloads: list[str]) -> Iterator[tuple[int, str, dict]]:
    """(world, payload, extra_info) of the `results` keyed by (world size, payload), world by world, payloads in
    their order; pairs not measured are left out."""
    for world in sorted({world for world, _ in results}):
        for payload in payloads:
            if (world, payload) in results:
                yield world, payload, results[(world, payload)]


def plot_times_by_payload(
    axis: Any, cases: dict, payloads: list[str], contenders: list[str], ylabel: str, title: str
) -> None:
    """One line per contender: its median time (`median_s`, in µs) at each payload of `cases` ({payload: info}),
    on a log scale."""
    for contender in contenders:
        points = [
            (i, cases[p]["median_s"][contender] * 1e6)
            for i, p in enumerate(payloads)
            if p in cases and contender in cases[p]["median_s"]
        ]
        if points:
            axis.plot(*zip(*points), marker="o", label=contender)
    axis.set(
        xticks=range(len(payloads)),
        xticklabels=payloads,
        yscale="log",
        xlabel="payload per rank",
        ylabel=ylabel,
        title=title,
    )
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()


@contextlib.contextmanager
def figure(path: Path, columns: int = 1, size: tuple[float, float] = (6.0, 4.5)) -> Iterator[list]:
    """A row of `columns` matplotlib axes (`size` is the whole figure), saved to `path` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")  # no display: reports are written by make targets and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=size, squeeze=False)
    yield list(axes[0])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out_dir: str, name: str, lines: list[str], plot: Callable[[Path], None] | None = None) -> Path:
    """Writes OUT_DIR/<name>.md from `lines` and, with `plot`, OUT_DIR/<name>.png through it; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines))
    if plot is not None:
        plot(out / f"{name}.png")
    return out
