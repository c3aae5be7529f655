"""The shared-memory process group's benchmark JSON files -> OUT_DIR/process_group.md and process_group.png.

    python benchmarks/report/process_group.py OUT_DIR allreduce-2.json allreduce-4.json training.json

Reads the `extra_info` of benchmarks/bench_allreduce.py (one file per world size) and benchmarks/bench_training.py:
per payload the median time per all_reduce of accel, gloo and the memcpy limit with the median of the per-round
gloo/accel ratios (quartiles in brackets), and per training workload the median steps per second with the
accel/other ratio. Higher ratios are better.
"""

from __future__ import annotations

import sys

import scaffold
from scaffold import MISSING, at_least, quartile_ratio, rank_spread, row, time_in

PAYLOADS = ["64B", "4KiB", "256KiB", "4MiB", "32MiB"]
CONTENDERS = ["limit", "accel", "gloo"]
# Issue 16's goals: gloo/accel per payload (and accel at most 35 us up to 4 KiB); accel/HF steps per second.
RATIO_GOALS = {"64B": 50, "4KiB": 50, "32MiB": 5}
LATENCY_GOAL_S = 35e-6
TRAINING_GOALS = {"mlp": 1.3, "gpt2": 1.3}


def split(benchmarks: list[tuple[str, dict]]) -> tuple[dict, dict]:
    """({(world, payload): extra_info} of the all-reduces, {workload: extra_info} of the training runs)."""
    reductions, training = {}, {}
    for _, info in benchmarks:
        if "workload" in info:
            training[info["workload"]] = info
        else:
            reductions[(info["world_size"], info["payload"])] = info
    return reductions, training


def _goal(payload: str, info: dict) -> str:
    goal = RATIO_GOALS.get(payload)
    checks = []
    if goal is not None:
        checks.append(at_least(goal, info["gloo/accel"]["median"]))
    if payload in ("64B", "4KiB"):
        met = info["median_s"]["accel"] <= LATENCY_GOAL_S
        checks.append(f"≤ 35 µs {'met' if met else 'NOT met'}")
    return ", ".join(checks) or MISSING


def reduction_table(reductions: dict) -> list[str]:
    rows = []
    for world, payload, info in scaffold.by_world_and_payload(reductions, PAYLOADS):
        t = info["median_s"]
        rows.append(
            row(
                world,
                payload,
                time_in(t["limit"], 1e6),
                time_in(t["accel"], 1e6),
                time_in(t["gloo"], 1e6),
                quartile_ratio(info.get("gloo/accel")),
                _goal(payload, info),
                f"{t['accel'] / t['limit']:.1f}",
                rank_spread(info),
            )
        )
    header = [
        "ranks",
        "payload/rank",
        "memcpy µs",
        "accel µs",
        "gloo µs",
        "**gloo / accel**",
        "goal",
        "accel / memcpy",
        "slowest/fastest rank",
    ]
    return scaffold.table(header, rows)


def training_table(training: dict) -> list[str]:
    rows = []
    for workload, info in training.items():
        rates = info["median_steps_per_s"]
        for name in [n for n in rates if n != "accel"]:
            ratio = info.get(f"accel/{name}")
            goal = TRAINING_GOALS.get(workload)
            met = MISSING if goal is None or ratio is None else at_least(goal, ratio["median"])
            rows.append(
                row(
                    workload,
                    info["steps"],
                    name,
                    f"accel {rates['accel']:.1f}, {name} {rates[name]:.1f}",
                    quartile_ratio(ratio),
                    met,
                    f"{info['max_relative_loss_difference']:.1e}",
                )
            )
    header = ["workload", "steps timed", "contender", "steps/s", "**accel / contender**", "goal", "max loss difference"]
    return scaffold.table(header, rows)


def plot(reductions: dict, training: dict, path) -> None:
    worlds = sorted({world for world, _ in reductions})
    with scaffold.figure(path, len(worlds) + 1, (5.5 * (len(worlds) + 1), 4.5)) as axes:
        for axis, world in zip(axes, worlds):
            cases = {payload: info for (w, payload), info in reductions.items() if w == world}
            scaffold.plot_times_by_payload(
                axis, cases, PAYLOADS, CONTENDERS, "median µs per all_reduce", f"all_reduce float32, {world} ranks"
            )
        labels, values = [], []
        for workload, info in training.items():
            for name, rate in info["median_steps_per_s"].items():
                labels.append(f"{workload}\n{name}")
                values.append(rate)
        axis = axes[-1]
        colors = ["tab:orange" if "accel" in label else "tab:gray" for label in labels]
        axis.bar(range(len(values)), values, color=colors)
        axis.set(
            xticks=range(len(labels)),
            xticklabels=labels,
            ylabel="median steps per second",
            title="training on 2 processes",
        )
        axis.grid(True, axis="y", alpha=0.3)


def main(out_dir: str, *paths: str) -> None:
    benchmarks, machine = scaffold.load(list(paths))
    reductions, training = split(benchmarks)
    text = [
        "# Shared-memory process group: all_reduce and training against gloo",
        "",
        f"Generated by `make bench-process-group` on {scaffold.cpu_name(machine)} "
        f"({scaffold.cpu_count(machine)} cores). `accel` is `torch.distributed.all_reduce` on the group `PartialState`",
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
    scaffold.write(out_dir, "process_group", text, lambda png: plot(reductions, training, png))


if __name__ == "__main__":
    main(*sys.argv[1:])
