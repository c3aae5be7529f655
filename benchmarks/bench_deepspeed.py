"""DeepSpeed ZeRO on 2 CPU processes (issue 22): steps per second, per-rank memory and loss parity of the GPT-2 of
bench_fsdp2.py (3.4 M parameters) under accel's Accelerator against DeepSpeed used directly, in one run.

    pytest benchmarks/bench_deepspeed.py --benchmark-only -p no:cacheprovider

(`make bench-deepspeed` writes docs/benchmarks/deepspeed.md and deepspeed.png.) Each round launches
benchmarks/deepspeed_job.py once per contender, in an order that alternates between rounds:
- `accel_zero1` / `accel_zero2` / `accel_zero3`: the Accelerate-API loop launched as a user launches it with
  DeepSpeed, `accel launch --cpu --num_processes 2 --use_deepspeed --zero_stage N` (DeepSpeed's engine on accel's
  shared-memory group);
- `raw_zero2` / `raw_zero3`: DeepSpeed used directly (`deepspeed.initialize`, `engine.backward`, `engine.step`) under
  torchrun, over plain gloo: what a DeepSpeed user has on CPU processes (HF Accelerate cannot run this job on CPU
  processes at all: `--cpu --use_deepspeed` is rejected, see the README);
- `accel_ddp`, `accel_fsdp2`: the same script launched with DDP and with FSDP2 (GPT2Block as the unit).
The losses of every step must agree between all contenders (same model, same batches per rank). Goals (issue 22):
accel_zero2 / raw_zero2 and accel_zero3 / raw_zero3 ≥ 1.5 in steps per second; each rank's optimizer state under
ZeRO-1/2 and its parameters under ZeRO-3 ≤ DDP's / 2 + one bucket.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
from two_process_jobs import accel_launch, free_port, job_env, launch, per_round_ratio, relative_difference

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "5"))
STEPS, WARMUP = 30, 5
CONTENDERS = ("accel_zero2", "raw_zero2", "accel_zero3", "raw_zero3", "accel_zero1", "accel_ddp", "accel_fsdp2")
SPEED_GOAL = 1.5
JOB_TIMEOUT_S = 600
FSDP_FLAGS = (
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "GPT2Block",
    "--fsdp_cpu_ram_efficient_loading",
    "false",
)


def command(contender: str, out: Path) -> list[str]:
    """The launch of one 2-process job (loopback only)."""
    port = str(free_port())
    job = [str(HERE / "deepspeed_job.py"), "--steps", str(STEPS), "--warmup", str(WARMUP), "--out", str(out)]
    if contender.startswith("raw"):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            *job,
            "--runner",
            "raw",
            "--stage",
            contender[-1],
        ]
    flags = {"accel_ddp": (), "accel_fsdp2": FSDP_FLAGS}.get(
        contender, ("--use_deepspeed", "--zero_stage", contender[-1])
    )
    return accel_launch(port, *flags, *job, "--runner", "accel")


def child_env() -> dict[str, str]:
    return job_env(TRANSFORMERS_VERBOSITY="error")


def run(contender: str, workspace: Path) -> list[dict]:
    """One job; both ranks' reports."""
    out = workspace / contender
    launch(command(contender, out), child_env(), workspace, f"the {contender} job", JOB_TIMEOUT_S)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


RATIOS = (
    "accel_zero2/raw_zero2",
    "accel_zero3/raw_zero3",
    "accel_zero2/accel_ddp",
    "accel_zero3/accel_fsdp2",
    "accel_zero1/accel_ddp",
)


@pytest.mark.timeout(ROUNDS * len(CONTENDERS) * JOB_TIMEOUT_S + 60)  # past every job's own deadline
def test_deepspeed_training(benchmark, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    reports: dict[str, list[list[dict]]] = {name: [] for name in CONTENDERS}

    def one_round() -> None:
        order = CONTENDERS if len(rates["accel_zero2"]) % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            reports[name].append(run(name, tmp_path))
            rates[name].append(min(rank["steps_per_s"] for rank in reports[name][-1]))

    benchmark.group = "deepspeed, GPT-2 3.4 M, 2 processes"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    first = {name: runs[0] for name, runs in reports.items()}
    strategies = {name: first[name][0]["strategy"] for name in CONTENDERS}
    assert strategies["accel_zero2"] == "DEEPSPEED ZeRO-2" and strategies["accel_zero3"] == "DEEPSPEED ZeRO-3", (
        strategies
    )
    backends = {name: first[name][0]["backend"] for name in CONTENDERS}
    assert backends["raw_zero2"] == "gloo" and backends["accel_zero2"] == "accel", backends
    losses = {
        name: max(
            relative_difference(first[name][rank]["losses"], first["accel_ddp"][rank]["losses"]) for rank in (0, 1)
        )
        for name in CONTENDERS
    }
    assert max(losses.values()) < 1e-3, f"the losses differ from DDP's (relative): {losses}"
    benchmark.extra_info.update(
        {
            "workload": "deepspeed training",
            "steps": STEPS,
            "warmup": WARMUP,
            "rounds": ROUNDS,
            "steps_per_s": rates,
            "ratios": {key: per_round_ratio(rates[key.split("/")[0]], rates[key.split("/")[1]]) for key in RATIOS},
            "speed_goal": SPEED_GOAL,
            "strategies": strategies,
            "backends": backends,
            "cpu_ms_per_step": {
                name: [statistics.mean(rank["cpu_ms_per_step"] for rank in run) for run in runs]
                for name, runs in reports.items()
            },
            "collective_ms_per_step": {
                name: [statistics.mean(rank["collective_ms_per_step"] for rank in run) for run in runs]
                for name, runs in reports.items()
            },
            "peak_rss_mib": {
                name: [statistics.median(run[rank]["peak_rss_bytes"] / 2**20 for run in runs) for rank in (0, 1)]
                for name, runs in reports.items()
            },
            "optimizer_state_bytes": {
                name: [rank["optimizer_state_bytes"] for rank in first[name]] for name in CONTENDERS
            },
            "parameter_bytes": {name: [rank["parameter_bytes"] for rank in first[name]] for name in CONTENDERS},
            "max_relative_loss_difference": losses,
            "losses": {name: first[name][0]["losses"] for name in ("accel_zero2", "raw_zero2", "accel_ddp")},
        }
    )
