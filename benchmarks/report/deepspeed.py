"""bench_deepspeed.py's pytest-benchmark JSON -> OUT_DIR/deepspeed.md and deepspeed.png.

    python benchmarks/report/deepspeed.py OUT_DIR results.json

Each contender's median steps per second and CPU time per step, the medians of the per-round ratios (quartiles in
brackets) with the speed goals, what each rank holds (optimizer state, parameters) against DDP's with the memory
goals, peak RSS, and the loss parity of every contender against accel's DDP.
"""

from __future__ import annotations

import statistics
import sys

import scaffold
from scaffold import MISSING, at_least, quartile_ratio, row

CONTENDERS = ["accel_zero2", "raw_zero2", "accel_zero3", "raw_zero3", "accel_zero1", "accel_ddp", "accel_fsdp2"]
LABELS = {
    "accel_zero1": "accel ZeRO-1",
    "accel_zero2": "accel ZeRO-2",
    "accel_zero3": "accel ZeRO-3",
    "raw_zero2": "DeepSpeed ZeRO-2, gloo",
    "raw_zero3": "DeepSpeed ZeRO-3, gloo",
    "accel_ddp": "accel DDP",
    "accel_fsdp2": "accel FSDP2",
}
RATIOS = {
    "accel_zero2/raw_zero2": "accel ZeRO-2 / DeepSpeed ZeRO-2 over gloo",
    "accel_zero3/raw_zero3": "accel ZeRO-3 / DeepSpeed ZeRO-3 over gloo",
    "accel_zero2/accel_ddp": "accel ZeRO-2 / accel DDP",
    "accel_zero1/accel_ddp": "accel ZeRO-1 / accel DDP",
    "accel_zero3/accel_fsdp2": "accel ZeRO-3 / accel FSDP2",
}
GOALS = {"accel_zero2/raw_zero2", "accel_zero3/raw_zero3"}
MIB = 2**20
# What the memory goal bounds, per contender: ZeRO-1/2 partition the optimizer state, ZeRO-3 the parameters too.
MEMORY_GOAL = {
    "accel_zero1": "optimizer_state_bytes",
    "accel_zero2": "optimizer_state_bytes",
    "accel_zero3": "parameter_bytes",
}
# ZeRO pads each rank's partition to an alignment; what the bound allows on top of DDP's half.
PARTITION_SLACK_BYTES = 64 * 1024


def median_of(info: dict, key: str, name: str) -> float:
    return statistics.median(info[key][name])


def speed_table(info: dict) -> list[str]:
    rows = [
        row(
            LABELS[name],
            f"{median_of(info, 'steps_per_s', name):.2f}",
            f"{1e3 / median_of(info, 'steps_per_s', name):.0f}",
            f"{median_of(info, 'cpu_ms_per_step', name):.0f}",
            f"{median_of(info, 'collective_ms_per_step', name):.1f}"
            if name.startswith(("accel_zero", "raw"))
            else MISSING,
            info["backends"][name],
        )
        for name in CONTENDERS
    ]
    return scaffold.table(
        [
            "contender",
            "steps/s (median; slower rank)",
            "ms per step",
            "CPU ms per step (mean of ranks, median)",
            "ms per step in ZeRO's collectives",
            "gradients move through",
        ],
        rows,
    )


def where_it_goes(info: dict) -> list[str]:
    """What the ZeRO-2 goal would need, from the step and collective times measured in this run."""
    step = {name: 1e3 / median_of(info, "steps_per_s", name) for name in ("accel_zero2", "raw_zero2", "accel_ddp")}
    comm = {name: median_of(info, "collective_ms_per_step", name) for name in ("accel_zero2", "raw_zero2")}
    engine = step["accel_zero2"] - comm["accel_zero2"]
    bound = step["raw_zero2"] / engine
    goal = info["speed_goal"]
    zero3 = info["ratios"]["accel_zero3/raw_zero3"]["median"]
    accel_step, accel_comm, raw_step, raw_comm = (
        step["accel_zero2"],
        comm["accel_zero2"],
        step["raw_zero2"],
        comm["raw_zero2"],
    )
    return [
        f"Where a ZeRO-2 step goes: accel's takes {accel_step:.0f} ms, {accel_comm:.1f} of them in ZeRO's",
        "collectives (the gradients' all-reduce, the parameters' all-gather); DeepSpeed's own over gloo takes",
        f"{raw_step:.0f} ms, {raw_comm:.1f} in the same collectives. The shared-memory group makes them",
        f"{raw_comm / max(accel_comm, 1e-9):.1f}× faster; the other {engine:.0f} ms are the model's "
        f"compute and DeepSpeed's engine (DDP's whole step is {step['accel_ddp']:.0f} ms). With collectives that "
        "took no",
        f"time at all, ZeRO-2 would run {bound:.2f}× DeepSpeed's over gloo"
        + (f": the {goal}× goal is out of the process group's reach on this model" if bound < goal else "")
        + f"; ZeRO-3, whose many per-layer gathers are latency-bound, runs {zero3:.2f}× (goal {goal}×).",
    ]


def ratio_table(info: dict) -> list[str]:
    rows = []
    for key, label in RATIOS.items():
        ratio = info["ratios"][key]
        goal = at_least(info["speed_goal"], ratio["median"]) if key in GOALS else MISSING
        numerator, denominator = key.split("/")
        cpu = statistics.median(info["cpu_ms_per_step"][denominator]) / statistics.median(
            info["cpu_ms_per_step"][numerator]
        )
        rows.append(row(label, f"**{quartile_ratio(ratio, 2)}**", goal, f"{cpu:.2f}×"))
    return scaffold.table(
        ["steps per second", "median of per-round ratios", "goal", "same, in CPU time per step"], rows
    )


def memory_table(info: dict) -> list[str]:
    rows = []
    for name in CONTENDERS:
        optimizer, parameters = (info[key][name] for key in ("optimizer_state_bytes", "parameter_bytes"))
        goal = MISSING
        if name in MEMORY_GOAL:
            key = MEMORY_GOAL[name]
            bound = max(info[key]["accel_ddp"]) / 2 + PARTITION_SLACK_BYTES
            goal = f"{'met' if max(info[key][name]) <= bound else 'NOT met'} (≤ {bound / MIB:.2f})"
        rows.append(
            row(
                LABELS[name],
                " / ".join(f"{b / MIB:.2f}" for b in optimizer),
                " / ".join(f"{b / MIB:.2f}" for b in parameters),
                goal,
                " / ".join(f"{mib:.0f}" for mib in info["peak_rss_mib"][name]),
            )
        )
    return scaffold.table(
        [
            "contender",
            "optimizer state MiB, rank 0 / 1",
            "parameters held MiB, rank 0 / 1",
            "goal: ZeRO-1/2 optimizer state, ZeRO-3 parameters ≤ DDP's / 2",
            "peak RSS MiB, rank 0 / 1",
        ],
        rows,
    )


def plot(info: dict, path) -> None:
    with scaffold.figure(path, 2, (13.0, 4.5)) as (speed, memory):
        ticks = range(len(CONTENDERS))
        labels = [LABELS[n].replace(" ", "\n") for n in CONTENDERS]
        colours = ["C0" if n.startswith("accel") else "C1" for n in CONTENDERS]
        speed.bar(ticks, [statistics.median(info["steps_per_s"][n]) for n in CONTENDERS], color=colours)
        speed.set(
            xticks=ticks, ylabel="median steps per second", title="GPT-2 3.4 M, 2 CPU processes (higher is better)"
        )
        speed.set_xticklabels(labels, fontsize=7)
        speed.grid(True, axis="y", alpha=0.3)
        width = 0.4
        memory.bar(
            [t - width / 2 for t in ticks],
            [info["optimizer_state_bytes"][n][0] / MIB for n in CONTENDERS],
            width,
            label="optimizer state",
        )
        memory.bar(
            [t + width / 2 for t in ticks],
            [info["parameter_bytes"][n][0] / MIB for n in CONTENDERS],
            width,
            label="parameters held",
        )
        memory.set(xticks=ticks, ylabel="MiB on rank 0", title="state per rank")
        memory.set_xticklabels(labels, fontsize=7)
        memory.grid(True, axis="y", alpha=0.3)
        memory.legend(fontsize=7)


def main(out_dir: str, *paths: str) -> None:
    benchmarks, machine = scaffold.load(list(paths))
    info = next((info for _, info in benchmarks if info.get("workload") == "deepspeed training"), None)
    if info is None:
        raise SystemExit(f"no DeepSpeed training benchmark in {', '.join(paths)}")
    losses = info["max_relative_loss_difference"]
    worst = max(losses, key=losses.get)
    text = [
        "# DeepSpeed ZeRO on 2 CPU processes: accel against DeepSpeed used directly",
        "",
        f"Generated by `make bench-deepspeed` on {scaffold.cpu_name(machine)} ({scaffold.cpu_count(machine)} cores).",
        "benchmarks/deepspeed_job.py trains the GPT-2 of the FSDP2 benchmark (4 layers of width 256, 3.4 M",
        "parameters, sequences of 32 tokens, batches of 4 per rank, fp32, AdamW, clipping at 1.0) on 2 processes of",
        "one thread each:",
        "",
        "- `accel ZeRO-N`: the loop on accel's API (`prepare`, `backward`, `clip_grad_norm_`, `optimizer.step`) as a",
        "  user launches it: `accel launch --cpu --num_processes 2 --use_deepspeed --zero_stage N`; DeepSpeed's",
        "  engine runs on accel's shared-memory process group;",
        '- `DeepSpeed ZeRO-N, gloo`: DeepSpeed used directly (`deepspeed.init_distributed("gloo")`,',
        "  `deepspeed.initialize` with the same config, `engine.backward`, `engine.step`) under torchrun: what a",
        "  DeepSpeed user has on CPU processes. HF Accelerate cannot run the accel job on CPU processes: `accelerate",
        "  launch --cpu --use_deepspeed` is rejected, `--use_deepspeed` alone records a world of 1 on both ranks and",
        "  fails DeepSpeed's batch-size check, `Accelerator(cpu=True)` drops the plugin (see the README);",
        "- `accel DDP`, `accel FSDP2`: the same script launched without DeepSpeed, and with `--use_fsdp` (GPT2Block",
        "  units).",
        "",
        f"Each job times {info['steps']} steps after {info['warmup']} warm-up steps, in {info['rounds']} round"
        f"{'s' * (info['rounds'] != 1)} (the order of the jobs alternates). Steps per second are the slower rank's,",
        "medians over rounds; ratios the median of the per-round ratios, their quartiles in brackets. `CPU ms per",
        "step` is each process's CPU time per timed step (mean of the ranks, median over rounds).",
        "",
        *speed_table(info),
        "",
        *ratio_table(info),
        "",
        *where_it_goes(info),
        "",
        "## Memory per rank",
        "",
        "From the first round, after the last step: the optimizer's state tensors each rank holds (Adam's moments;",
        "under ZeRO over its partition of the flattened parameters) and the parameters it holds (ZeRO-3's",
        "partitions, FSDP2's shards, else whole). The bound is DDP's over 2 processes plus 64 KiB of partition",
        "alignment. Peak RSS is `getrusage`'s high-water mark, median over rounds (DeepSpeed's import included).",
        "",
        *memory_table(info),
        "",
        "## Loss parity",
        "",
        "Every step's loss (both ranks, first round) against accel's DDP: the largest relative difference is",
        f"**{losses[worst]:.1e}** ({LABELS[worst]}); DeepSpeed used directly and accel's ZeRO see the same batches",
        f"per rank (accel ZeRO-2 against DeepSpeed ZeRO-2: {losses['raw_zero2']:.1e} vs {losses['accel_zero2']:.1e}",
        "from DDP).",
        "",
        "![DeepSpeed on 2 CPU processes](deepspeed.png)",
        "",
    ]
    scaffold.write(out_dir, "deepspeed", text, lambda png: plot(info, png))


if __name__ == "__main__":
    main(*sys.argv[1:])
