"""Turns bench_gather.py's pytest-benchmark JSON files (one per world size) into a table and a plot.

    python tools/bench_gather_report.py OUT_DIR results-2.json results-4.json

Writes OUT_DIR/gather.md and OUT_DIR/gather.png from each benchmark's `extra_info`: per contender the median
time per call over the interleaved rounds, and per ratio the median of the per-round ratios with its quartiles
(the run-to-run spread). Ratios are HF time / accel time: higher is better.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAYLOADS = ["64B", "4KiB", "256KiB", "4MiB", "32MiB"]
CONTENDERS = ["limit", "accel", "fused", "reference", "hf"]
# Issue 13's goals, HF/accel through the public API: per payload, and for the evaluation pass.
GOALS = {(2, "64B"): 20, (2, "4KiB"): 20, (2, "256KiB"): 10, (2, "4MiB"): 4, (2, "32MiB"): 4, (4, "64B"): 10,
         (4, "4KiB"): 10, (2, "eval"): 8}  # fmt: skip


def load(paths: list[str]) -> tuple[dict, dict]:
    """({(world, payload or "eval"): extra_info}, machine info)."""
    results, machine = {}, {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        machine = data.get("machine_info", machine)
        for bench in data["benchmarks"]:
            info = bench["extra_info"]
            results[(info["world_size"], info.get("payload", "eval"))] = info
    return results, machine


def _time(seconds: float | None, unit: float) -> str:
    return "—" if seconds is None else f"{seconds * unit:,.1f}"


def _ratio(info: dict, name: str) -> str:
    ratio = info.get(name)
    return "—" if ratio is None else f"{ratio['median']:.1f}× ({ratio['q1']:.1f}–{ratio['q3']:.1f})"


def _goal(world: int, payload: str, info: dict) -> str:
    goal = GOALS.get((world, payload))
    if goal is None or "hf/accel" not in info:
        return "—"
    return f"≥ {goal}× {'met' if info['hf/accel']['median'] >= goal else 'NOT met'}"


def _starvation(info: dict) -> str:
    """The slowest rank's median over the fastest's: 1.0 when no rank waits on a starved peer more than others."""
    per_rank = info.get("per_rank_accel_median_s")
    return "—" if not per_rank else f"{max(per_rank) / min(per_rank):.2f}"


def gather_table(results: dict) -> list[str]:
    lines = ["| ranks | payload/rank | memcpy µs | accel µs | HF µs | **HF / accel** | goal | fused op µs | "
             "HF / fused op | gloo reference µs | slowest/fastest rank |", "|" + "---|" * 11]  # fmt: skip
    for world in sorted({world for world, _ in results}):
        for payload in PAYLOADS:
            info = results.get((world, payload))
            if info is None:
                continue
            t = info["median_s"]
            fused = info.get("fused/accel", {}).get("median")
            hf_fused = (info["hf/accel"]["median"] / fused) if fused else None
            lines.append(f"| {world} | {payload} | {_time(t.get('limit'), 1e6)} | {_time(t.get('accel'), 1e6)} | "
                         f"{_time(t.get('hf'), 1e6)} | {_ratio(info, 'hf/accel')} | {_goal(world, payload, info)} | "
                         f"{_time(t.get('fused'), 1e6)} | {'—' if hf_fused is None else f'{hf_fused:.0f}×'} | "
                         f"{_time(t.get('reference'), 1e6)} | {_starvation(info)} |")  # fmt: skip
    return lines


def pass_table(results: dict) -> list[str]:
    lines = ["| ranks | no gather ms | accel ms | HF ms | **HF / accel** | goal | gloo reference ms |",
             "|" + "---|" * 7]  # fmt: skip
    for world in sorted({world for world, payload in results if payload == "eval"}):
        info = results[(world, "eval")]
        t = info["median_s"]
        lines.append(f"| {world} | {_time(t.get('limit'), 1e3)} | {_time(t.get('accel'), 1e3)} | "
                     f"{_time(t.get('hf'), 1e3)} | {_ratio(info, 'hf/accel')} | {_goal(world, 'eval', info)} | "
                     f"{_time(t.get('reference'), 1e3)} |")  # fmt: skip
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({world for world, payload in results if payload != "eval"})
    figure, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for axis, world in zip(axes[0], worlds):
        for contender in CONTENDERS:
            points = [(i, results[(world, p)]["median_s"][contender] * 1e6) for i, p in enumerate(PAYLOADS)
                      if (world, p) in results and contender in results[(world, p)]["median_s"]]  # fmt: skip
            if points:
                axis.plot(*zip(*points), marker="o", label=contender)
        axis.set(xticks=range(len(PAYLOADS)), xticklabels=PAYLOADS, yscale="log", xlabel="payload per rank",
                 ylabel="median µs per call", title=f"pad_across_processes + gather, {world} ranks")  # fmt: skip
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(out_dir: str, *paths: str) -> None:
    results, machine = load(list(paths))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu = machine.get("cpu", {})
    eval_info = next((info for (_, payload), info in results.items() if payload == "eval"), {})
    text = [
        "# Padded all-gather through the public API: accel vs HF Accelerate",
        "",
        f"Generated by `make bench-gather` on {cpu.get('brand_raw', 'an unknown CPU')} ({cpu.get('count', '?')} "
        "cores), in one run per world size. `accel` and `HF` are the same user code, `pad_across_processes(t)` then",
        "`gather(...)`, through each library's public API, timed in interleaved rounds (the order alternates);",
        "times are medians per call, ratios the median of the per-round ratios with their quartiles in brackets",
        "(the run-to-run spread). Rank r sends 64·r bytes fewer than the payload, so padding happens. `memcpy`",
        "copies the gathered bytes once into a fresh buffer: the limit. `fused op` is `accel::shm_all_gather`",
        "with `pad_dim=0`, the same result in one op call (the op-level column); `gloo reference` is accel's two",
        "calls through its torch.distributed transport. `slowest/fastest rank` compares the ranks' own medians",
        "(starvation shows as a rank much slower than the others).",
        "",
        *gather_table(results),
        "",
        f"## gather_for_metrics over an evaluation pass ({eval_info.get('rows', '?')} samples, batch "
        f"{eval_info.get('batch_size', '?')}, uneven last batch)",
        "",
        *pass_table(results),
        "",
        "![padded all-gather](gather.png)",
        "",
    ]
    (out / "gather.md").write_text("\n".join(text))
    plot(results, out / "gather.png")


if __name__ == "__main__":
    main(*sys.argv[1:])
