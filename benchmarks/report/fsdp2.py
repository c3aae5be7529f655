"""bench_fsdp2.py's pytest-benchmark JSON -> OUT_DIR/fsdp2.md and fsdp2.png.

    python benchmarks/report/fsdp2.py OUT_DIR results.json

The training benchmark gives each contender's median steps per second with the medians of the per-round ratios
(quartiles in brackets), where a step's time goes, each rank's resident state and peak RSS, and the loss parity of
FSDP2 against DDP. Every benchmark whose extra_info has a `measure` (the checkpoint saves: `accel`, `reference`,
`reference_name`, `ratio`, `goal`; optionally `synchronous`) becomes one row of the save table, so a save measured
later (the asynchronous one) appears when the JSON has it.
"""

from __future__ import annotations

import statistics
import sys

import scaffold
from scaffold import MISSING, at_least, quartile_ratio, row

CONTENDERS = ["accel_fsdp", "accel_ddp", "raw_shm", "raw_gloo", "raw_gloo_malloc"]
LABELS = {
    "accel_fsdp": "accel FSDP2",
    "accel_ddp": "accel DDP",
    "raw_shm": "torch fully_shard, shm",
    "raw_gloo": "torch fully_shard, gloo",
    "raw_gloo_malloc": "torch fully_shard, gloo, accel's malloc settings",
}
RATIOS = {
    "accel_fsdp/raw_gloo": "accel FSDP2 / torch fully_shard over gloo",
    "accel_fsdp/raw_shm": "accel FSDP2 / torch fully_shard over shm",
    "raw_shm/raw_gloo": "torch fully_shard: shm / gloo",
    "accel_fsdp/accel_ddp": "accel FSDP2 / accel DDP",
    "accel_fsdp/raw_gloo_malloc": "accel FSDP2 / torch fully_shard over gloo with accel's malloc settings",
    "raw_gloo_malloc/raw_gloo": "torch fully_shard over gloo: accel's malloc settings / glibc's",
}
PHASES = {
    "forward_backward": "forward + backward (gathers, reduce-scatters)",
    "clip": "clip_grad_norm_",
    "optimizer": "optimizer.step",
    "zero_grad": "zero_grad",
}
MIB = 2**20


def split(benchmarks: list[tuple[str, dict]]) -> tuple[dict | None, list[dict]]:
    """(the training benchmark's extra_info or None, the save rows' extra_infos in the JSON's order)."""
    training = next((info for _, info in benchmarks if info.get("workload") == "fsdp2 training"), None)
    return training, [info for _, info in benchmarks if "measure" in info]


def speed_table(info: dict) -> list[str]:
    rows = [
        row(
            LABELS[name],
            f"{statistics.median(info['steps_per_s'][name]):.2f}",
            f"{statistics.median(info['cpu_ms_per_step'][name]):.0f}",
        )
        for name in CONTENDERS
    ]
    return scaffold.table(["contender", "steps/s (median)", "CPU ms per step (mean of ranks, median)"], rows)


def ratio_table(info: dict) -> list[str]:
    rows = []
    for key, label in RATIOS.items():
        ratio = info["ratios"][key]
        goal = at_least(info["speed_goal"], ratio["median"]) if key == "accel_fsdp/raw_gloo" else MISSING
        numerator, denominator = key.split("/")
        cpu = statistics.median(info["cpu_ms_per_step"][denominator]) / statistics.median(
            info["cpu_ms_per_step"][numerator]
        )
        rows.append(row(label, f"**{quartile_ratio(ratio, 2)}**", goal, f"{cpu:.2f}×"))
    return scaffold.table(
        ["steps per second", "median of per-round ratios", "goal", "same, in CPU time per step"], rows
    )


def phase_table(info: dict) -> list[str]:
    """Each phase's median wall time (rank 0) and CPU time (both ranks), ms."""
    rows = []
    cpu_phases = info.get("cpu_phase_ms", {})
    for name in CONTENDERS:
        wall, cpu = info["phase_ms"][name], cpu_phases.get(name, {})
        cells = [
            f"{wall[phase]:.1f} / {cpu[phase]:.1f}" if phase in cpu else f"{wall[phase]:.1f} / {MISSING}"
            for phase in PHASES
        ]
        rows.append(
            row(
                LABELS[name],
                *cells,
                f"{1e3 / statistics.median(info['steps_per_s'][name]):.0f}",
                f"{statistics.median(info['cpu_ms_per_step'][name]):.0f}",
            )
        )
    return scaffold.table(
        ["contender", *(f"{label}, wall / CPU ms" for label in PHASES.values()), "ms per step", "CPU ms per step"], rows
    )


def where_it_goes(info: dict) -> list[str]:
    """The CPU time of each phase of accel's FSDP2 step against torch's loop and DDP, in words."""
    cpu = info.get("cpu_phase_ms")
    if not cpu:
        return []
    fsdp, shm, gloo, ddp = (cpu[name] for name in CONTENDERS[:1] + ["raw_shm", "raw_gloo", "accel_ddp"])
    total = statistics.median(info["cpu_ms_per_step"]["accel_fsdp"])
    extra = fsdp["forward_backward"] - ddp["forward_backward"]
    gloo_total, malloc_total = (statistics.median(info["cpu_ms_per_step"][name]) for name in CONTENDERS[3:5])
    return [
        f"Of accel FSDP2's {total:.0f} CPU ms per step, forward + backward take {fsdp['forward_backward']:.0f}, DDP's",
        f"{ddp['forward_backward']:.0f}: the model's compute is the same, the {extra:.0f} ms more are torch's FSDP2",
        "code (all-gather copy-in and copy-out, reduce-scatter, per-unit hooks), as in the hand-written loop over the",
        f"same group ({shm['forward_backward']:.0f} ms; over gloo {gloo['forward_backward']:.0f} ms). accel's own",
        f"phases cost less than torch's: `clip_grad_norm_` {fsdp['clip']:.1f} ms (torch's over DTensors",
        f"{shm['clip']:.1f} ms),",
        f"`optimizer.step` {fsdp['optimizer']:.1f} ms on the local shards (torch's AdamW over DTensors",
        f"{shm['optimizer']:.1f} ms). The glibc malloc settings `accel launch` gives CPU ranks do not speed up",
        f"torch's loop over gloo ({malloc_total:.0f} CPU ms per step against {gloo_total:.0f}: gloo's copies through",
        "TCP dominate there). They pay on the shared-memory path, where a step's gather outputs and reduce-scatter",
        "inputs are copied through memory: under glibc's own thresholds those buffers are faulted in again every step",
        "(about 3,000 page faults a step on each rank; accel/cli/cpu_malloc.py).",
    ]


def resident_mib(info: dict, name: str) -> list[float]:
    """Each rank's parameters + gradients + optimizer state, MiB."""
    return [sum(rank.values()) / MIB for rank in info["resident_bytes"][name]]


def memory_bound_mib(info: dict) -> float:
    """The goal's bound per rank: DDP's resident state / 2 processes + the largest wrapped block's parameters."""
    return max(resident_mib(info, "accel_ddp")) / 2 + info["largest_unit_bytes"] / MIB


def memory_table(info: dict) -> list[str]:
    bound = memory_bound_mib(info)
    rows = []
    for name in CONTENDERS:
        ranks = info["resident_bytes"][name]
        parts = " / ".join(
            f"{statistics.mean(rank[part] for rank in ranks) / MIB:.1f}"
            for part in ("parameters", "gradients", "optimizer")
        )
        total = resident_mib(info, name)
        goal = MISSING if name == "accel_ddp" else f"≤ {bound:.1f} {'met' if max(total) <= bound else 'NOT met'}"
        rows.append(
            row(
                LABELS[name],
                parts,
                " / ".join(f"{mib:.2f}" for mib in total),
                goal,
                " / ".join(f"{mib:.0f}" for mib in info["peak_rss_mib"][name]),
            )
        )
    return scaffold.table(
        [
            "contender",
            "parameters / gradients / optimizer MiB (mean of ranks)",
            "resident MiB, rank 0 / rank 1",
            "goal: ≤ DDP / 2 + largest block",
            "peak RSS MiB, rank 0 / rank 1",
        ],
        rows,
    )


def save_table(saves: list[dict]) -> list[str]:
    """One row per save measure, then one per further reference of it (`also`: reference_name, reference, ratio)."""
    rows = []
    for info in saves:
        goal = info.get("goal")
        met = MISSING if goal is None else f"≤ {goal}× {'met' if info['ratio']['median'] <= goal else 'NOT met'}"
        note = " (its DCP shards still written before it returns)" if info.get("synchronous") else ""
        rows.append(
            row(
                info["measure"] + note,
                scaffold.time_in(info["accel"], 1e3),
                info["reference_name"],
                scaffold.time_in(info["reference"], 1e3),
                f"**{quartile_ratio(info['ratio'], 2)}**",
                met,
                info["repeats"],
            )
        )
        first = info.get("first_s")
        if first:  # the runs' first saves, apart from the repeats
            accel_first, reference_first = (first[name] for name in list(first)[:2])
            rows.append(
                row(
                    "same, each run's first save (not in the repeats)",
                    scaffold.time_in(accel_first, 1e3),
                    "the same reference, first",
                    scaffold.time_in(reference_first, 1e3),
                    f"{accel_first / reference_first:.2f}×",
                    MISSING,
                    info["launches"],
                )
            )
        for other in info.get("also", []):
            rows.append(
                row(
                    "same",
                    "",
                    other["reference_name"],
                    scaffold.time_in(other["reference"], 1e3),
                    quartile_ratio(other["ratio"], 2),
                    MISSING,
                    info["repeats"],
                )
            )
    return scaffold.table(
        ["measure", "accel ms", "reference", "reference ms", "accel / reference", "goal", "repeats"], rows
    )


def save_section(saves: list[dict]) -> list[str]:
    if not saves:
        return []
    shard = saves[0]["shard_bytes"] / MIB
    return [
        "## Checkpoint saves",
        "",
        "accel's FSDP2 `save_state` on the same 2 ranks after 3 steps, each save timed from a barrier to the slowest",
        "rank's return and alternating with its reference (benchmarks/fsdp2_job.py `--runner checkpoint`); medians",
        "over every repeat of every launch, ratios the median of the per-repeat ratios, quartiles in brackets (lower",
        "is better). Each launch saves once of each kind before its repeats; those first saves have a row of their",
        "own (medians over launches): accel's first asynchronous save builds the state's trees and the copy that",
        "later saves refresh, the memcpy's first faults its buffers in.",
        f" With the tests' GPT-2 each rank holds {shard:.1f} MiB of parameter and optimizer shards; the",
        "asynchronous save is also timed on a GPT-2 of GPT-2 small's width (its row names the size): its fixed",
        "costs (the processes agreeing, the staging folder, the fingerprint of the state) weigh on a small state,",
        "the copy on a larger one.",
        "`save_state` writes HF's layout: `pytorch_model_fsdp_0/` and `optimizer_0/` (two DCP saves), RNG states",
        "and the rest, in a staging folder published atomically; the reference is one `dcp.save` of",
        '`{"model": get_model_state_dict, "optimizer": get_optimizer_state_dict}` into a plain folder.',
        "The second reference writes the same state in HF's layout (two DCP checkpoints, each with its own planning",
        "and metadata round, as `save_state` must): the difference between the two references is the layout's",
        "cost, the rest of `save_state`'s (the staging folder, RNG states, the processes agreeing, publishing) is",
        "the difference between `save_state` and the second.",
        "",
        *save_table(saves),
        "",
    ]


def plot(info: dict, path) -> None:
    with scaffold.figure(path, 3, (16.0, 4.5)) as (speed, phases, memory):
        values = [statistics.median(info["steps_per_s"][name]) for name in CONTENDERS]
        speed.bar(range(len(CONTENDERS)), values, color=[f"C{index}" for index in range(len(CONTENDERS))])
        speed.set(
            xticks=range(len(CONTENDERS)),
            ylabel="median steps per second",
            title="GPT-2 3.4 M, 2 CPU processes (higher is better)",
        )
        speed.set_xticklabels([LABELS[n].replace(", ", "\n") for n in CONTENDERS], fontsize=8)
        speed.grid(True, axis="y", alpha=0.3)
        base = [0.0] * len(CONTENDERS)
        for phase, label in PHASES.items():
            heights = [info["phase_ms"][name][phase] for name in CONTENDERS]
            phases.bar(range(len(CONTENDERS)), heights, bottom=base, label=label)
            base = [b + h for b, h in zip(base, heights)]
        cpu = [statistics.median(info["cpu_ms_per_step"][name]) for name in CONTENDERS]
        phases.plot(range(len(CONTENDERS)), cpu, "k_", markersize=18, markeredgewidth=2, label="CPU ms per step")
        phases.set(xticks=range(len(CONTENDERS)), ylabel="median ms per step (rank 0)", title="where a step goes")
        phases.set_xticklabels([LABELS[n].replace(", ", "\n") for n in CONTENDERS], fontsize=8)
        phases.grid(True, axis="y", alpha=0.3)
        phases.legend(fontsize=7)
        parts = ("parameters", "gradients", "optimizer")
        base = [0.0] * len(CONTENDERS)
        for part in parts:
            heights = [info["resident_bytes"][name][0][part] / MIB for name in CONTENDERS]
            memory.bar(range(len(CONTENDERS)), heights, bottom=base, label=part)
            base = [b + h for b, h in zip(base, heights)]
        memory.axhline(memory_bound_mib(info), color="k", linestyle="--", label="goal: DDP / 2 + largest block")
        memory.set(xticks=range(len(CONTENDERS)), ylabel="MiB resident on rank 0", title="state per rank")
        memory.set_xticklabels([LABELS[n].replace(", ", "\n") for n in CONTENDERS], fontsize=8)
        memory.grid(True, axis="y", alpha=0.3)
        memory.legend(fontsize=7)


def main(out_dir: str, *paths: str) -> None:
    benchmarks, machine = scaffold.load(list(paths))
    info, saves = split(benchmarks)
    if info is None:
        raise SystemExit(f"no FSDP2 training benchmark in {', '.join(paths)}")
    losses = info["max_relative_loss_difference"]
    text = [
        "# FSDP2 on 2 CPU processes: accel against torch's fully_shard",
        "",
        f"Generated by `make bench-fsdp2` on {scaffold.cpu_name(machine)} ({scaffold.cpu_count(machine)} cores).",
        "benchmarks/fsdp2_job.py trains a GPT-2 of 4 layers of width 256 (3.4 M parameters, a vocabulary of 1,024",
        "tied to the output layer, sequences of 32 tokens, batches of 4 per rank, fp32, AdamW, clipping at 1.0) on",
        "2 processes of one thread each:",
        "",
        "- `accel FSDP2`: the loop on accel's API (`prepare`, `backward`, `clip_grad_norm_`) launched as a user",
        "  launches it, `accel launch --cpu --num_processes 2 --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy",
        "  TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap GPT2Block --fsdp_state_dict_type",
        "  SHARDED_STATE_DICT --fsdp_cpu_ram_efficient_loading false` (HF's launch default for the last is true,",
        "  which accel refuses: not built yet); accel also makes the embedding and the tail units, as HF does;",
        "- `accel DDP`: the same script launched without `--use_fsdp`;",
        "- `torch fully_shard, gloo`: what a torch user writes by hand (torchrun): `fully_shard` on every GPT2Block,",
        "  then the root, AdamW, `torch.nn.utils.clip_grad_norm_`, over plain gloo;",
        "- `torch fully_shard, shm`: the same loop over gloo with accel's shared-memory backend underneath (what",
        "  accel's `PartialState` sets up): what the process group alone changes;",
        "- `torch fully_shard, gloo, accel's malloc settings`: the gloo loop with the glibc malloc settings",
        "  `accel launch` gives ranks that train on CPUs (`GLIBC_TUNABLES`, accel/cli/cpu_malloc.py: freed buffers",
        "  reused instead of faulted in again every step): what the launcher's allocator settings alone change.",
        "",
        f"Each job times {info['steps']} optimizer steps after {info['warmup']} warm-up steps, in {info['rounds']}",
        f"round{'s' * (info['rounds'] != 1)} (the order of the jobs alternates). Steps per second are rank 0's,",
        "medians over rounds; ratios the",
        "median of the per-round ratios, their quartiles in brackets. `CPU ms per step` is each process's CPU time",
        "per timed step (the mean of the two ranks, median over rounds): the work a step costs, which other load on",
        "this shared machine changes less than it changes the wall time.",
        "",
        *speed_table(info),
        "",
        *ratio_table(info),
        "",
        "## Where a step goes",
        "",
        "Each phase's median over the timed steps: wall time on rank 0, then CPU time (the process's, all its",
        "threads; median over both ranks' steps, then over rounds). `forward + backward` includes FSDP's all-gathers",
        "and reduce-scatters (DDP's all-reduce); a rank waiting for its peer waits in it, in wall time.",
        "",
        *phase_table(info),
        "",
        *where_it_goes(info),
        "",
        "## Memory per rank",
        "",
        "The bytes each rank holds after its last optimizer step: parameters, gradients and optimizer state, local",
        "shards only (a DTensor's `_local_tensor`), from the first round. The goal's bound is DDP's resident state",
        f"over 2 processes plus the largest wrapped block's parameters, whole ({info['largest_unit_bytes'] / MIB:.1f}",
        "MiB: what FSDP gathers at a time). Peak RSS is `getrusage`'s high-water mark (start-up, transformers and",
        "the shared-memory segments a rank maps included), median over rounds.",
        "",
        *memory_table(info),
        "",
        "## Loss parity",
        "",
        f"The losses of the first {info['parity_steps']} steps (both ranks, first round), max relative difference:",
        f"accel FSDP2 against accel DDP **{losses['accel_fsdp/accel_ddp']:.1e}**, accel FSDP2 against torch's",
        f"fully_shard over gloo {losses['accel_fsdp/raw_gloo']:.1e}, torch's fully_shard over shm against gloo",
        f"{losses['raw_shm/raw_gloo']:.1e}.",
        "",
        *save_section(saves),
        "![FSDP2 on 2 CPU processes](fsdp2.png)",
        "",
    ]
    scaffold.write(out_dir, "fsdp2", text, lambda png: plot(info, png))


if __name__ == "__main__":
    main(*sys.argv[1:])
