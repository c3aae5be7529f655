"""Turns the shared-memory process group's benchmark JSON files into a table and a plot.

    python tools/bench_process_group_report.py OUT_DIR allreduce-2.json allreduce-4.json training.json

Reads the `extra_info` of benchmarks/bench_allreduce.py (one file per world size) and benchmarks/bench_training.py,
and writes OUT_DIR/process_group.md and OUT_DIR/process_group.png: per payload the median time per all_reduce of
accel, gloo and the memcpy limit with the median of the per-round gloo/accel ratios (quartiles in brackets), and
per training workload the median steps per second with the accel/other ratio. Higher ratios are better.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAYLOADS = ["64B", "4KiB", "256KiB", "4MiB", "32MiB"]
CONTENDERS = ["limit", "accel", "gloo"]
# Issue 16's goals: gloo/accel per payload (and accel at most 35 us up to 4 KiB); accel/HF steps per second.
RATIO_GOALS = {"64B": 50, "4KiB": 50, "32MiB": 5}
LATENCY_GOAL_S = 35e-6
TRAINING_GOALS = {"mlp": 1.3, "gpt2": 1.3}


def load(paths: list[str]) -> tuple[dict, dict, dict]:
    """({(world, payload): extra_info}, {workload: extra_info}, machine info)."""
    reductions, training, machine = {}, {}, {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        machine = data.get("machine_info", machine)
        for bench in data["benchmarks"]:
            info = bench["extra_info"]
            if "workload" in info:
                training[info["workload"]] = info
            else:
                reductions[(info["world_size"], info["payload"])] = info
    return reductions, training, machine


def _time(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.1f}"


def _ratio(ratio: dict | None) -> str:
    return "—" if ratio is None else f"{ratio['median']:.1f}× ({ratio['q1']:.1f}–{ratio['q3']:.1f})"


def _goal(payload: str, info: dict) -> str:
    goal = RATIO_GOALS.get(payload)
    checks = []
    if goal is not None:
        checks.append(f"≥ {goal}× {'met' if info['gloo/accel']['median'] >= goal else 'NOT met'}")
    if payload in ("64B", "4KiB"):
        met = info["median_s"]["accel"] <= LATENCY_GOAL_S
        checks.append(f"≤ 35 µs {'met' if met else 'NOT met'}")
    return ", ".join(checks) or "—"


def _starvation(info: dict) -> str:
    per_rank = info.get("per_rank_accel_median_s")
    return "—" if not per_rank else f"{max(per_rank) / min(per_rank):.2f}"


def reduction_table(reductions: dict) -> list[str]:
    lines = ["| ranks | payload/rank | memcpy µs | accel µs | gloo µs | **gloo / accel** | goal | accel / memcpy | "
             "slowest/fastest rank |", "|" + "---|" * 9]  # fmt: skip
    for world in sorted({world for world, _ in reductions}):
        for payload in PAYLOADS:
            info = reductions.get((world, payload))
            if info is None:
                continue
            t = info["median_s"]
            lines.append(f"| {world} | {payload} | {_time(t['limit'])} | {_time(t['accel'])} | {_time(t['gloo'])} | "
                         f"{_ratio(info.get('gloo/accel'))} | {_goal(payload, info)} | "
                         f"{t['accel'] / t['limit']:.1f} | {_starvation(info)} |")  # fmt: skip
    return lines


def training_table(training: dict) -> list[str]:
    lines = ["| workload | steps timed | contender | steps/s | **accel / contender** | goal | max loss difference |",
             "|" + "---|" * 7]  # fmt: skip
    for workload, info in training.items():
        rates = info["median_steps_per_s"]
        for name in [n for n in rates if n != "accel"]:
            ratio = info.get(f"accel/{name}")
            goal = TRAINING_GOALS.get(workload)
            met = "—" if goal is None or ratio is None else f"≥ {goal}× {'met' if ratio['median'] >= goal else 'NOT met'}"
            lines.append(f"| {workload} | {info['steps']} | {name} | accel {rates['accel']:.1f}, {name} "
                         f"{rates[name]:.1f} | {_ratio(ratio)} | {met} | {info['max_relative_loss_difference']:.1e} |")
    return lines


def plot(reductions: dict, training: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({world for world, _ in reductions})
    figure, axes = plt.subplots(1, len(worlds) + 1, figsize=(5.5 * (len(worlds) + 1), 4.5), squeeze=False)
    for axis, world in zip(axes[0], worlds):
        for contender in CONTENDERS:
            points = [(i, reductions[(world, p)]["median_s"][contender] * 1e6) for i, p in enumerate(PAYLOADS)
                      if (world, p) in reductions]  # fmt: skip
            if points:
                axis.plot(*zip(*points), marker="o", label=contender)
        axis.set(xticks=range(len(PAYLOADS)), xticklabels=PAYLOADS, yscale="log", xlabel="payload per rank",
                 ylabel="median µs per all_reduce", title=f"all_reduce float32, {world} ranks")  # fmt: skip
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    axis = axes[0][-1]
    labels, values = [], []
    for workload, info in training.items():
        for name, rate in info["median_steps_per_s"].items():
            labels.append(f"{workload}\n{name}")
            values.append(rate)
    axis.bar(range(len(values)), values, color=["tab:orange" if "accel" in label else "tab:gray" for label in labels])
    axis.set(xticks=range(len(labels)), xticklabels=labels, ylabel="median steps per second",
             title="training on 2 processes")  # fmt: skip
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(out_dir: str, *paths: str) -> None:
    reductions, training, machine = load(list(paths))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu = machine.get("cpu", {})
    text = [
        "# Shared-memory process group: all_reduce and training against gloo",
        "",
        f"Generated by `make bench-process-group` on {cpu.get('brand_raw', 'an unknown CPU')} "
        f"({cpu.get('count', '?')} cores). `accel` is `torch.distributed.all_reduce` on the group `PartialState`",
        "starts (its CPU collectives through accel's shared-memory backend); `gloo` the same call on a gloo group of",
        "the same ranks (what HF Accelerate runs); `memcpy` one copy of the payload, the least an all-reduce moves.",
        "Rounds are interleaved (the order alternates); times are medians per call, ratios the median of the",
        "per-round ratios with their quartiles in brackets. `slowest/fastest rank` compares the ranks' own medians.",
        "",
        *reduction_table(reductions),
        "",
        "## Training on 2 processes (steps per second)",
        "",
        "The same script (benchmarks/training_job.py) launched with `torch.distributed.run`, once importing accel and",
        "once HF Accelerate 1.15 (`mlp`: examples/train.py's loop, `gpt2`: the tests' tiny GPT-2), and for `fsdp2`",
        "torch's `fully_shard` over accel's group and over plain gloo (ACCEL_TRANSPORT=torch). Jobs alternate.",
        "",
        *training_table(training),
        "",
        "![shared-memory process group](process_group.png)",
        "",
    ]
    (out / "process_group.md").write_text("\n".join(text))
    plot(reductions, training, out / "process_group.png")


if __name__ == "__main__":
    main(*sys.argv[1:])
