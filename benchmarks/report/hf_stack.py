"""bench_hf_stack.py's pytest-benchmark JSON -> OUT_DIR/hf_stack.md and hf_stack.png.

    python benchmarks/report/hf_stack.py OUT_DIR results.json

Per task (`lm`: transformers' `Trainer`, `sft`: TRL's `SFTTrainer`): the median steps per second of each contender,
the medians of the per-round ratios with their quartiles, where a step's time goes (each phase's median) and each
rank's peak RSS.
"""

from __future__ import annotations

import statistics
import sys

import scaffold
from scaffold import at_least, per_round_ratio, quartile_ratio, row

GOAL = 1.2  # issue 20: accel / HF Accelerate, steps per second
TASKS = {"lm": "lm: `Trainer`", "sft": "sft: TRL `SFTTrainer`"}
CONTENDERS = ["accel", "hf", "raw_shm", "raw_gloo"]
LABELS = {"accel": "accel", "hf": "HF Accelerate", "raw_shm": "raw DDP, shm", "raw_gloo": "raw DDP, gloo"}
PHASES = {
    "data": "between steps",
    "forward_backward": "forward + backward (sync, clip)",
    "optimizer": "optimizer",
    "schedule_zero_grad": "schedule + zero_grad",
}


def by_task(benchmarks: list[tuple[str, dict]]) -> dict:
    """{task: extra_info} of the training jobs, in TASKS' order."""
    found = {info["task"]: info for _, info in benchmarks if "task" in info}
    return {task: found[task] for task in TASKS if task in found}


def wrapper_info(benchmarks: list[tuple[str, dict]]) -> dict | None:
    """The extra_info of the Accelerator-call benchmark, if it ran."""
    return next((info for _, info in benchmarks if "wrappers" in info), None)


def ratio(info: dict, numerator: str, denominator: str) -> dict | None:
    """numerator/denominator of steps per second, per round: median and quartiles."""
    rates = info["steps_per_s"]
    return per_round_ratio(rates[numerator], rates[denominator], method="inclusive")


def speed_table(tasks: dict) -> list[str]:
    rows = []
    for task, info in tasks.items():
        rates = {name: statistics.median(info["steps_per_s"][name]) for name in CONTENDERS}
        accel_hf = ratio(info, "accel", "hf")
        rows.append(
            row(
                TASKS[task],
                *(f"{rates[name]:.1f}" for name in CONTENDERS),
                f"**{quartile_ratio(accel_hf, 2)}**",
                at_least(GOAL, accel_hf["median"]),
                quartile_ratio(ratio(info, "accel", "raw_shm"), 2),
                quartile_ratio(ratio(info, "hf", "raw_gloo"), 2),
                quartile_ratio(ratio(info, "raw_shm", "raw_gloo"), 2),
            )
        )
    header = [
        "task",
        "accel steps/s",
        "HF steps/s",
        "raw DDP shm steps/s",
        "raw DDP gloo steps/s",
        "**accel / HF**",
        "goal",
        "accel / raw shm",
        "HF / raw gloo",
        "raw shm / raw gloo",
    ]
    return scaffold.table(header, rows)


def phase_table(tasks: dict) -> list[str]:
    rows = []
    for task, info in tasks.items():
        for name in CONTENDERS:
            phases = info["phase_ms"][name]
            rows.append(
                row(
                    TASKS[task],
                    LABELS[name],
                    *(f"{phases[phase]:.2f}" for phase in PHASES),
                    f"{1e3 / statistics.median(info['steps_per_s'][name]):.1f}",
                    f"{statistics.median(info['cpu_ms_per_step'][name]):.1f}",
                )
            )
    header = ["task", "contender", *(f"{label} ms" for label in PHASES.values()), "ms per step", "CPU ms per step"]
    return scaffold.table(header, rows)


def memory_table(tasks: dict) -> list[str]:
    rows = []
    for task, info in tasks.items():
        rss = info["peak_rss_mib"]
        excess = max(a - h for a, h in zip(rss["accel"], rss["hf"]))
        rows.append(
            row(TASKS[task], *(" / ".join(f"{mib:.1f}" for mib in rss[name]) for name in CONTENDERS), f"{excess:+.1f}")
        )
    header = ["task", *(f"{LABELS[name]} MiB" for name in CONTENDERS), "accel − HF, worse rank MiB"]
    return scaffold.table(header, rows)


def _call_us(info: dict, library: str, name: str) -> tuple[float, float]:
    """(wrapper, torch) µs of one call: medians over rounds of each round's median."""
    sides = info["wrappers"][library][name]
    return statistics.median(sides["wrapper_us"]), statistics.median(sides["torch_us"])


def wrapper_table(info: dict) -> list[str]:
    """Each call a step makes: accel's and HF's µs, their torch call's, the difference; then the sums per step."""
    per_step = info["per_step"]
    names = list(info["wrappers"]["accel"])
    extra = {
        library: {name: _call_us(info, library, name)[0] - _call_us(info, library, name)[1] for name in names}
        for library in ("accel", "hf")
    }
    rows = []
    for name in names:
        counts = " / ".join(
            str(per_step["lm"].get(name, 0) + per_step["sft"].get(name, 0) * (task == "sft")) for task in TASKS
        )
        cells = [f"{value:.1f}" for library in ("accel", "hf") for value in _call_us(info, library, name)]
        rows.append(
            row(
                f"`{name}`",
                counts,
                cells[0],
                cells[1],
                f"**{extra['accel'][name]:+.1f}**",
                cells[2],
                cells[3],
                f"**{extra['hf'][name]:+.1f}**",
            )
        )
    for task in TASKS:
        counts = {
            name: per_step["lm"].get(name, 0) + (per_step["sft"].get(name, 0) if task == "sft" else 0) for name in names
        }
        sums = {library: sum(counts[name] * extra[library][name] for name in names) for library in extra}
        rows.append(
            row(f"per step, {TASKS[task]}", "", "", "", f"**{sums['accel']:+.0f}**", "", "", f"**{sums['hf']:+.0f}**")
        )
    header = [
        "call",
        "per step (lm / sft)",
        "accel µs",
        "torch µs",
        "accel − torch µs",
        "HF µs",
        "torch µs",
        "HF − torch µs",
    ]
    return scaffold.table(header, rows)


def wrapper_section(info: dict | None) -> list[str]:
    if info is None:
        return []
    return [
        "## What the Accelerator's calls cost",
        "",
        "Each call the `Trainer` makes through the Accelerator every optimizer step (TRL's `SFTTrainer` adds 4",
        "`gather_for_metrics`), against the torch call it stands for on the same objects and the same group",
        "(benchmarks/hf_stack_wrappers.py on 2 processes: runs of 50 calls in a row, started together on both ranks,",
        f"alternating with runs of the torch call; medians over 10 runs, then over {info['rounds']} rounds).",
        "`backward` is that of a 2-node graph and the `gather`s move one integer, so the differences are the",
        "wrappers' own cost; accel's `clip_grad_norm_` is its fused kernel, faster than torch's. The last rows sum",
        "the differences over a step.",
        "",
        *wrapper_table(info),
        "",
    ]


def plot(tasks: dict, path) -> None:
    with scaffold.figure(path, 2, (12.0, 4.5)) as (speed, phases):
        width = 0.8 / len(CONTENDERS)
        for index, name in enumerate(CONTENDERS):
            values = [statistics.median(info["steps_per_s"][name]) for info in tasks.values()]
            speed.bar([t + (index - 1.5) * width for t in range(len(tasks))], values, width, label=LABELS[name])
        speed.set(
            xticks=range(len(tasks)),
            xticklabels=[TASKS[task].replace("`", "") for task in tasks],
            ylabel="median steps per second",
            title="2 CPU processes (higher is better)",
        )
        speed.grid(True, axis="y", alpha=0.3)
        speed.legend()
        labels, bottoms = [], []
        for task, info in tasks.items():
            for name in CONTENDERS:
                labels.append(f"{task}\n{LABELS[name].replace(', ', chr(10))}")
                bottoms.append(info["phase_ms"][name])
        base = [0.0] * len(labels)
        for phase, label in PHASES.items():
            heights = [step[phase] for step in bottoms]
            phases.bar(range(len(labels)), heights, bottom=base, label=label)
            base = [b + h for b, h in zip(base, heights)]
        cpu = [statistics.median(info["cpu_ms_per_step"][name]) for info in tasks.values() for name in CONTENDERS]
        phases.plot(range(len(labels)), cpu, "k_", markersize=18, markeredgewidth=2, label="CPU ms per step")
        phases.set(xticks=range(len(labels)), ylabel="median ms per step", title="where a step goes")
        phases.set_xticklabels(labels, fontsize=7)
        phases.grid(True, axis="y", alpha=0.3)
        phases.legend(fontsize=8)


def main(out_dir: str, *paths: str) -> None:
    benchmarks, machine = scaffold.load(list(paths))
    tasks = by_task(benchmarks)
    wrappers = wrapper_info(benchmarks)
    info = next(iter(tasks.values()))
    rounds = info["rounds"]
    text = [
        "# Trainer and TRL on 2 CPU processes: accel against HF Accelerate",
        "",
        f"Generated by `make bench-hf-stack` on {scaffold.cpu_name(machine)} ({scaffold.cpu_count(machine)} cores).",
        "benchmarks/hf_stack_job.py trains a GPT-2 of 2 layers of width 64 (170 k parameters, a vocabulary of",
        "1,005, sequences of 64 tokens, batches of 8 per rank, fp32) with transformers' `Trainer` on packed text",
        "(`lm`) and with TRL's `SFTTrainer` on raw text (`sft`), on 2 processes of one thread each. `accel` is the",
        "job as a user runs it on accel, `accel launch --cpu --num_processes 2 --as_accelerate`; `HF` the same job",
        "on HF Accelerate 1.15, `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`. The limit: the same model and",
        "batches in a raw torch DDP loop (DDP set up as the `Trainer` sets it up, fused AdamW, a linear schedule,",
        "`clip_grad_norm_`), over gloo with accel's shared-memory backend underneath (`raw DDP shm`: what accel's",
        "`PartialState` sets up) and over plain gloo (`raw DDP gloo`: HF's).",
        "",
        f"Each job times {info['steps']} optimizer steps after {info['warmup']} warm-up steps, in {rounds} round"
        f"{'s' * (rounds != 1)} (the order of the jobs alternates).",
        "Steps per second are medians over rounds; ratios the median of the per-round ratios, their quartiles in",
        "brackets. accel's and HF's logged losses agree (max relative difference "
        + ", ".join(f"{task} {i['max_relative_loss_difference']['accel/hf']:.1e}" for task, i in tasks.items())
        + ": the fused clip's rounding).",
        "",
        *speed_table(tasks),
        "",
        "`accel / raw shm` is what the `Trainer` (or TRL) and accel's wrappers cost against a loop that runs the same",
        "model on the same group; `HF / raw gloo` the same for HF Accelerate; `raw shm / raw gloo` what the",
        "shared-memory group alone wins in a raw loop.",
        "",
        "## Where a step goes",
        "",
        "Rank 0's medians over the timed steps, from the `Trainer`'s callbacks (the raw loop stamps the same points):",
        "`between steps` runs from the previous step's end to this one's start (the next batches, the `Trainer`'s",
        "token count across ranks, logging); `forward + backward` includes DDP's gradient all-reduce, TRL's per-step",
        "metrics (gathered across ranks) and the clipping. `CPU ms per step` is the process's CPU time (all its",
        "threads) per timed step, the mean of the two ranks, median over rounds: the work a step costs, which other",
        "load on the machine changes less than it changes the wall time.",
        "",
        *phase_table(tasks),
        "",
        *wrapper_section(wrappers),
        "## Peak memory",
        "",
        "Each rank's peak resident set (`getrusage` high-water mark, start-up included; the shared-memory segments a",
        "rank maps count in it), median over rounds, rank 0 / rank 1.",
        "",
        *memory_table(tasks),
        "",
        "![Trainer and TRL on 2 CPU processes](hf_stack.png)",
        "",
    ]
    scaffold.write(out_dir, "hf_stack", text, lambda png: plot(tasks, png))


if __name__ == "__main__":
    main(*sys.argv[1:])
