"""bench_gather.py's pytest-benchmark JSON files (one per world size) -> OUT_DIR/gather.md and gather.png.

    python benchmarks/report/gather.py OUT_DIR results-2.json results-4.json

From each benchmark's `extra_info`: per contender the median time per call over the interleaved rounds, and per
ratio the median of the per-round ratios with its quartiles (the run-to-run spread). Ratios are HF time / accel
time (higher is better), except accel / forward only in the evaluation pass with a model (lower is better).
"""

from __future__ import annotations

import sys

import scaffold
from scaffold import MISSING, at_least, at_most, quartile_ratio, rank_spread, row, time_in

PAYLOADS = ["64B", "4KiB", "256KiB", "4MiB", "32MiB"]
CONTENDERS = ["limit", "accel", "fused", "reference", "hf"]
# Issue 13's goals, HF/accel through the public API: per payload, and for the evaluation pass.
GOALS = {
    (2, "64B"): 20,
    (2, "4KiB"): 20,
    (2, "256KiB"): 10,
    (2, "4MiB"): 4,
    (2, "32MiB"): 4,
    (4, "64B"): 10,
    (4, "4KiB"): 10,
    (2, "eval"): 8,
}
# Issue 23's goals: accel's time per call (µs), and for the evaluation pass with a model, on 2 ranks.
TIME_GOALS_US = {(2, "64B"): 12}
MODEL_PASS = "eval+mlp"  # bench_gather.py's payload name for the evaluation pass with a model's forward
MODEL_PASS_GOALS = {"accel/forward": 1.5, "hf/accel": 8, "gather per batch µs": 40}


def by_case(benchmarks: list[tuple[str, dict]]) -> dict:
    """{(world, payload or "eval"): extra_info} (the payload of the evaluation pass with a model is MODEL_PASS)."""
    return {(info["world_size"], info.get("payload", "eval")): info for _, info in benchmarks}


def _goal(world: int, payload: str, info: dict) -> str:
    goal, time_goal = GOALS.get((world, payload)), TIME_GOALS_US.get((world, payload))
    met = []
    if goal is not None and "hf/accel" in info:
        met.append(at_least(goal, info["hf/accel"]["median"]))
    if time_goal is not None and "accel" in info["median_s"]:
        met.append(at_most(time_goal, info["median_s"]["accel"] * 1e6, " µs"))
    return "; ".join(met) or MISSING


def gather_table(results: dict) -> list[str]:
    rows = []
    for world, payload, info in scaffold.by_world_and_payload(results, PAYLOADS):
        t = info["median_s"]
        fused = info.get("fused/accel", {}).get("median")
        hf_fused = (info["hf/accel"]["median"] / fused) if fused else None
        rows.append(
            row(
                world,
                payload,
                time_in(t.get("limit"), 1e6),
                time_in(t.get("accel"), 1e6),
                time_in(t.get("hf"), 1e6),
                quartile_ratio(info.get("hf/accel")),
                _goal(world, payload, info),
                time_in(t.get("fused"), 1e6),
                MISSING if hf_fused is None else f"{hf_fused:.0f}×",
                time_in(t.get("reference"), 1e6),
                rank_spread(info),
            )
        )
    header = [
        "ranks",
        "payload/rank",
        "memcpy µs",
        "accel µs",
        "HF µs",
        "**HF / accel**",
        "goal",
        "fused op µs",
        "HF / fused op",
        "gloo reference µs",
        "slowest/fastest rank",
    ]
    return scaffold.table(header, rows)


def pass_table(results: dict) -> list[str]:
    rows = []
    for world in sorted({world for world, payload in results if payload == "eval"}):
        info = results[(world, "eval")]
        t = info["median_s"]
        rows.append(
            row(
                world,
                time_in(t.get("limit"), 1e3),
                time_in(t.get("accel"), 1e3),
                time_in(t.get("hf"), 1e3),
                quartile_ratio(info.get("hf/accel")),
                _goal(world, "eval", info),
                time_in(t.get("reference"), 1e3),
            )
        )
    header = ["ranks", "no gather ms", "accel ms", "HF ms", "**HF / accel**", "goal", "gloo reference ms"]
    return scaffold.table(header, rows)


def model_pass_table(results: dict) -> list[str]:
    rows = []
    for world in sorted({world for world, payload in results if payload == MODEL_PASS}):
        info = results[(world, MODEL_PASS)]
        t, per_batch = info["median_s"], info["gather_per_batch_s"] * 1e6
        barrier = info.get("barrier_per_batch_s")
        goals = [MISSING] * 3
        if world == 2:
            goals = [
                at_most(MODEL_PASS_GOALS["accel/forward"], info["accel/limit"]["median"]),
                at_least(MODEL_PASS_GOALS["hf/accel"], info["hf/accel"]["median"]),
                at_most(MODEL_PASS_GOALS["gather per batch µs"], per_batch, " µs"),
            ]
        rows.append(
            row(
                world,
                time_in(t.get("limit"), 1e3),
                time_in(t.get("accel"), 1e3),
                time_in(t.get("hf"), 1e3),
                quartile_ratio(info["accel/limit"], 2),
                goals[0],
                quartile_ratio(info.get("hf/accel")),
                goals[1],
                f"{per_batch:,.1f}",
                goals[2],
                MISSING if barrier is None else f"{barrier * 1e6:,.1f}",
            )
        )
    header = [
        "ranks",
        "forward only ms",
        "accel ms",
        "HF ms",
        "**accel / forward**",
        "goal",
        "**HF / accel**",
        "goal",
        "gathering per batch µs",
        "goal",
        "a barrier per batch µs",
    ]
    return scaffold.table(header, rows)


def model_pass_breakdown_table(results: dict) -> list[str]:
    """Per batch: the rank's own work (loader + forward) when the ranks run free (the forward-only pass) and in step
    (the barrier's and the gather's passes, their time inside the call taken out), and the time inside the call."""
    rows = []
    for world in sorted({world for world, payload in results if payload == MODEL_PASS}):
        info = results[(world, MODEL_PASS)]
        own = info.get("own_work_per_batch_s")
        if own is None:
            continue
        rows.append(
            row(
                world,
                f"{own['free'] * 1e6:,.1f}",
                f"{own['barrier'] * 1e6:,.1f}",
                f"{info['inside_barrier_per_batch_s'] * 1e6:,.1f}",
                f"{own['accel'] * 1e6:,.1f}",
                f"{info['inside_gather_per_batch_s'] * 1e6:,.1f}",
            )
        )
    header = [
        "ranks",
        "own work, ranks free µs",
        "own work, in step (barrier) µs",
        "inside the barrier µs",
        "own work, in step (gather) µs",
        "inside the gather µs",
    ]
    return scaffold.table(header, rows) if rows else []


def plot(results: dict, path) -> None:
    worlds = sorted({world for world, payload in results if payload in PAYLOADS})
    with scaffold.figure(path, len(worlds), (6 * len(worlds), 4.5)) as axes:
        for axis, world in zip(axes, worlds):
            cases = {payload: info for (w, payload), info in results.items() if w == world}
            scaffold.plot_times_by_payload(
                axis, cases, PAYLOADS, CONTENDERS, "median µs per call", f"pad_across_processes + gather, {world} ranks"
            )


def main(out_dir: str, *paths: str) -> None:
    benchmarks, machine = scaffold.load(list(paths))
    results = by_case(benchmarks)
    eval_info = next((info for (_, payload), info in results.items() if payload == "eval"), {})
    model_info = next((info for (_, payload), info in results.items() if payload == MODEL_PASS), {})
    text = [
        "# Padded all-gather through the public API: accel vs HF Accelerate",
        "",
        f"Generated by `make bench-gather` on {scaffold.cpu_name(machine)} ({scaffold.cpu_count(machine)} "
        "cores), in one run per world size. `accel` and `HF` are the same user code, `pad_across_processes(t)` then",
        "`gather(...)`, through each library's public API, timed in interleaved rounds (the order alternates);",
        "accel's calls run on the group as `PartialState` makes it (its collectives through the group's shared",
        "memory), HF's on the same group's gloo backend alone, as HF's users have it;",
        "times are medians per call, ratios the median of the per-round ratios with their quartiles in brackets",
        "(the run-to-run spread). Rank r sends 64·r bytes fewer than the payload, so padding happens. `memcpy`",
        "copies the gathered bytes once into a fresh buffer: the limit. `fused op` is `accel::shm_all_gather`",
        "with `pad_dim=0`, the same result in one op call (the op-level column); `gloo reference` is accel's two",
        "calls through its torch.distributed transport over plain gloo. `slowest/fastest rank` compares the ranks'",
        "own medians",
        "(starvation shows as a rank much slower than the others).",
        "",
        *gather_table(results),
        "",
        f"## gather_for_metrics over an evaluation pass ({eval_info.get('rows', '?')} samples, batch "
        f"{eval_info.get('batch_size', '?')}, uneven last batch)",
        "",
        *pass_table(results),
        "",
        f"## An evaluation pass with a model ({model_info.get('rows', '?')} samples, batch "
        f"{model_info.get('batch_size', '?')}, a 2-layer MLP, predictions and labels through gather_for_metrics)",
        "",
        "The user's whole loop: the prepared loader, the prepared model's forward under `torch.no_grad()`, then",
        "`gather_for_metrics((predictions, labels))` per batch. `forward only` is accel's same loop without the",
        "gather (the limit). accel's passes are timed until every rank has finished them (a barrier ends each):",
        "a pass is done when its slowest rank is, and the forward-only pass has no collective to line the ranks up.",
        "`gathering per batch` is the median over rounds of (accel - forward only) / batches,",
        "what each call costs inside the loop, waiting for the slower rank included; `a barrier per batch` is the",
        "same for `wait_for_everyone()` in place of the gather, in the same rounds: the least any collective per",
        "batch costs there (one rendezvous, and the wait for the rank whose forward took longer).",
        "",
        *model_pass_table(results),
        "",
        "Where a batch's time goes in those passes (medians per batch): the rank's own work (the prepared loader and",
        "the forward) when the ranks run free (the forward-only pass) and when a collective per batch keeps them in",
        "step (the time inside the call taken out), and the time inside the call (the rendezvous, the wait for the",
        "slower rank, the copies).",
        "",
        *model_pass_breakdown_table(results),
        "",
        "![padded all-gather](gather.png)",
        "",
    ]
    scaffold.write(out_dir, "gather", text, lambda path: plot(results, path))


if __name__ == "__main__":
    main(*sys.argv[1:])
