"""transformers' `Trainer` and TRL's `SFTTrainer` on 2 CPU processes: steps per second under accel standing in for
HF Accelerate and under HF Accelerate 1.15 itself, in one run, with a raw torch DDP loop of the same model as the
limit.

    pytest benchmarks/bench_hf_stack.py --benchmark-only -p no:cacheprovider

(`make bench-hf-stack` writes docs/benchmarks/hf_stack.md and hf_stack.png.) Per task (`lm`: `Trainer` on packed
text; `sft`: `SFTTrainer` on raw text) each round launches benchmarks/hf_stack_job.py once per contender, in an
order that alternates between rounds:
- `accel`: the job as a user runs it on accel, `accel launch --cpu --num_processes 2 --as_accelerate`;
- `hf`: the same job on HF Accelerate, `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`;
- `raw_shm` / `raw_gloo`: the same model and batches in a plain torch DDP loop (torchrun), over gloo with accel's
  shared-memory backend underneath (what accel's `PartialState` sets up) / over plain gloo (what HF's does).
`raw_shm` is what accel's `Trainer` job would run at if the `Trainer`, TRL and accel's wrappers cost nothing;
`raw_shm / raw_gloo` is what the shared-memory group alone can win. Each job times its steps after a warm-up and
reports its ranks' CPU time per step and peak RSS; the report (benchmarks/report/hf_stack.py) takes the median over
rounds of each round's ratio of steps per second (issue 20's goal: accel / hf ≥ 1.2). accel's and HF's logged
losses must agree, and so must the two raw loops'. A third benchmark times each Accelerator call a `Trainer` step
makes against the torch call it stands for (benchmarks/hf_stack_wrappers.py), accel and HF alternating.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
from two_process_jobs import accel_launch, free_port, job_env, launch, relative_difference

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "5"))
STEPS, WARMUP = 100, 10
CONTENDERS = ("accel", "hf", "raw_shm", "raw_gloo")
JOB_TIMEOUT_S = 600


def command(contender: str, task: str, out: Path) -> list[str]:
    """The launch of one 2-process job (loopback only)."""
    job = [
        str(HERE / "hf_stack_job.py"),
        "--task",
        task,
        "--steps",
        str(STEPS),
        "--warmup",
        str(WARMUP),
        "--out",
        str(out),
    ]
    job += ["--runner", "trainer"] if contender in ("accel", "hf") else ["--runner", "raw", "--group", contender[4:]]
    port = str(free_port())
    if contender == "accel":
        return accel_launch(port, "--as_accelerate", *job)
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
    ]


def child_env(contender: str, home: Path) -> dict[str, str]:
    """The same environment for every job, offline, one thread per rank; HF's jobs are told to use the CPU."""
    env = job_env(HF_HOME=str(home), HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true")
    if contender == "hf":
        env["ACCELERATE_USE_CPU"] = "1"
    return env


def run_wrappers(library: str, workspace: Path) -> dict:
    """hf_stack_wrappers.py on 2 processes (torchrun) with `library` ("accel" or "hf"); rank 0's report."""
    out = workspace / f"wrappers-{library}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(HERE / "hf_stack_wrappers.py"),
        "--library",
        "accelerate" if library == "hf" else "accel",
        "--out",
        str(out),
    ]
    launch(command, child_env(library, workspace / "hf_home"), workspace, f"the {library} wrapper job", JOB_TIMEOUT_S)
    return json.loads(out.read_text())


def run_job(contender: str, task: str, workspace: Path) -> dict:
    """One job; rank 0's report with both ranks' peak RSS (`peak_rss_bytes`: [rank 0, rank 1]) and their mean CPU
    time per step."""
    out = workspace / f"{contender}-{task}"
    launch(
        command(contender, task, out),
        child_env(contender, workspace / "hf_home"),
        workspace,
        f"the {contender} {task} job",
        JOB_TIMEOUT_S,
    )
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return {
        **ranks[0],
        "peak_rss_bytes": [rank["peak_rss_bytes"] for rank in ranks],
        "cpu_ms_per_step": statistics.mean(rank["cpu_ms_per_step"] for rank in ranks),
    }


@pytest.mark.timeout(ROUNDS * len(CONTENDERS) * JOB_TIMEOUT_S + 60)  # past every job's own deadline
@pytest.mark.parametrize("task", ["lm", "sft"])
def test_hf_stack_steps_per_second(benchmark, task, tmp_path):
    pytest.importorskip("accelerate", reason="HF Accelerate is not installed: `pip install accelerate==1.15.0`")
    pytest.importorskip("transformers")
    if task == "sft":
        pytest.importorskip("trl")
        pytest.importorskip("datasets")
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    reports: dict[str, list[dict]] = {name: [] for name in CONTENDERS}

    def one_round() -> None:
        order = CONTENDERS if len(rates["accel"]) % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            reports[name].append(run_job(name, task, tmp_path))
            rates[name].append(reports[name][-1]["steps_per_s"])

    benchmark.group = f"hf stack, {task}, 2 processes"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    first = {name: runs[0] for name, runs in reports.items()}
    assert first["accel"]["library"] == "accel.accelerator", first["accel"]["library"]
    assert first["hf"]["library"] == "accelerate.accelerator", first["hf"]["library"]
    loss_difference = {
        "accel/hf": relative_difference(first["accel"]["losses"], first["hf"]["losses"]),
        "raw_shm/raw_gloo": relative_difference(first["raw_shm"]["losses"], first["raw_gloo"]["losses"]),
    }
    assert max(loss_difference.values()) < 1e-3, f"the losses differ (relative): {loss_difference}"
    benchmark.extra_info.update(
        {
            "task": task,
            "steps": STEPS,
            "warmup": WARMUP,
            "rounds": ROUNDS,
            "steps_per_s": rates,
            "median_steps_per_s": {name: statistics.median(values) for name, values in rates.items()},
            "cpu_ms_per_step": {name: [run["cpu_ms_per_step"] for run in runs] for name, runs in reports.items()},
            "phase_ms": {
                name: {
                    phase: statistics.median(run["phase_ms"][phase] for run in runs) for phase in runs[0]["phase_ms"]
                }
                for name, runs in reports.items()
            },
            "peak_rss_mib": {
                name: [statistics.median(run["peak_rss_bytes"][rank] / 2**20 for run in runs) for rank in (0, 1)]
                for name, runs in reports.items()
            },
            "max_relative_loss_difference": loss_difference,
        }
    )


@pytest.mark.timeout(ROUNDS * 2 * JOB_TIMEOUT_S + 60)
def test_wrapper_cost_per_call(benchmark, tmp_path):
    """Each Accelerator call a `Trainer` step makes, against the torch call it stands for (hf_stack_wrappers.py),
    accel and HF Accelerate alternating; the per-round medians are kept."""
    pytest.importorskip("accelerate", reason="HF Accelerate is not installed: `pip install accelerate==1.15.0`")
    pytest.importorskip("transformers")
    reports: dict[str, list[dict]] = {"accel": [], "hf": []}

    def one_round() -> None:
        for library in reports if len(reports["accel"]) % 2 == 0 else list(reports)[::-1]:
            reports[library].append(run_wrappers(library, tmp_path))

    benchmark.group = "hf stack, Accelerator calls, 2 processes"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    assert reports["accel"][0]["library"] == "accel.accelerator"
    assert reports["hf"][0]["library"] == "accelerate.accelerator"
    calls = {
        library: {
            name: {side: [run["calls"][name][side] for run in runs] for side in ("wrapper_us", "torch_us")}
            for name in runs[0]["calls"]
        }
        for library, runs in reports.items()
    }
    benchmark.extra_info.update({"wrappers": calls, "per_step": reports["accel"][0]["per_step"], "rounds": ROUNDS})
