"""One rank of a job timed by bench_deepspeed.py: the GPT-2 of benchmarks/fsdp2_job.py trained on 2 CPU processes
under accel's Accelerator (DeepSpeed ZeRO, DDP or FSDP2, as the launcher says), or under DeepSpeed used directly.

    accel launch --cpu --num_processes 2 --use_deepspeed --zero_stage 2 benchmarks/deepspeed_job.py \
        --runner accel --out r
    accel launch --cpu --num_processes 2 benchmarks/deepspeed_job.py --runner accel --out r          # DDP
    torchrun --nproc_per_node 2 benchmarks/deepspeed_job.py --runner raw --stage 2 --out r

`accel`: the loop a user writes on the Accelerate API (`prepare` of the model, AdamW and a DataLoader, `backward`,
`clip_grad_norm_`, `optimizer.step`, `zero_grad`); the launcher picks the strategy. `raw`: what a DeepSpeed user
writes without Accelerate: `deepspeed.init_distributed("gloo")` (plain gloo), `deepspeed.initialize` with the same
config accel's launch flags give (ZeRO stage, micro batch 4, clipping 1.0, the torch AdamW), `engine.backward`,
`engine.step`. DeepSpeed's own shared-memory all-reduce op is kept from building in both (a minute's JIT build that
only its tensor-parallel inference all-reduce uses). Every runner trains the same model on the same batches (each
rank its own: the accel runner's DataLoader hands rank r what the raw runner draws for it).

After `--warmup` steps each rank times `--steps` steps and writes `--out`/rank<N>.json: {"steps_per_s",
"cpu_ms_per_step", "collective_ms_per_step" (wall time inside torch.distributed's collectives called from Python,
as DeepSpeed calls them: ZeRO's gradient reductions and parameter gathers; DDP's and FSDP2's run from C++ hooks and
are not counted), "losses" (every step), "optimizer_state_bytes" (the optimizer's state tensors this rank holds:
Adam's moments, over ZeRO's partition), "parameter_bytes" (the parameters it holds: ZeRO-3's partitions, FSDP's
shards, else whole), "peak_rss_bytes", "strategy", "backend" (the CPU backend of the group the gradients move
through)}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp2_job import BATCH, LEARNING_RATE, MAX_GRAD_NORM, gpt2, local, rank_batches

# The collectives ZeRO calls through torch.distributed's Python functions (looked up at each call, or cached by
# DeepSpeed's comm backend when it starts: so they are wrapped before anything starts).
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "all_to_all_single",
)
collective_seconds = [0.0]


def time_collectives() -> None:
    """Adds every call's wall time of the COLLECTIVES to `collective_seconds`."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def timed(*args, _real=real, **kwargs):
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                collective_seconds[0] += time.perf_counter() - start

        setattr(dist, name, timed)


def interleaved_loader(world_size: int, steps: int) -> torch.utils.data.DataLoader:
    """A DataLoader whose batch i on rank r (after accel's sharding: batches dealt out in turn) is
    rank_batches(r)[i]."""
    per_rank = [rank_batches(rank, steps) for rank in range(world_size)]
    rows = torch.cat([per_rank[rank][step] for step in range(steps) for rank in range(world_size)])
    return torch.utils.data.DataLoader(rows, batch_size=BATCH)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        local(value).numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    )


def parameter_bytes(module: torch.nn.Module) -> int:
    """The parameter bytes this rank holds: ZeRO-3's partition (`ds_tensor`), an FSDP shard, or the whole."""

    def held(p):
        tensor = getattr(p, "ds_tensor", None)
        tensor = local(p) if tensor is None else tensor
        return tensor.numel() * tensor.element_size()

    return sum(held(p) for p in module.parameters())


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under accel's wrapper and under ZeRO's (which steps it over its flat partitions)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accel's wrapper
    return getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer


def gradient_backend() -> str:
    """The CPU backend ZeRO's collectives run on (DeepSpeed's clone of the world group), else the default group's."""
    group = dist.group.WORLD
    groups = __import__("sys").modules.get("deepspeed.utils.groups")
    if groups is not None and groups._WORLD_GROUP is not None:
        group = groups._WORLD_GROUP
    return group._get_backend(torch.device("cpu")).name()


def accel_training(steps: int) -> tuple[list[float], list[float], dict]:
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, interleaved_loader(accelerator.num_processes, steps)
    )
    losses, stamps = [], []
    for tokens in loader:
        stamps.append((time.perf_counter(), time.process_time(), collective_seconds[0]))
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stamps.append((time.perf_counter(), time.process_time(), collective_seconds[0]))
    module = getattr(model, "module", model)
    facts = {
        "optimizer_state_bytes": optimizer_state_bytes(inner_optimizer(optimizer)),
        "parameter_bytes": parameter_bytes(module),
        "backend": gradient_backend(),
        "strategy": "FSDP2" if accelerator.is_fsdp2 else str(accelerator.distributed_type).split(".")[-1],
    }
    if accelerator.deepspeed_plugin is not None:
        facts["strategy"] += f" ZeRO-{accelerator.deepspeed_plugin.zero_stage}"
    accelerator.end_training()
    return losses, stamps, facts


def raw_training(stage: int, steps: int) -> tuple[list[float], list[float], dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as a DeepSpeed user on CPUs sets it (accel sets it too)
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
    deepspeed.init_distributed(dist_backend="gloo")
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
    }
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, stamps = [], []
    for tokens in rank_batches(dist.get_rank(), steps):
        stamps.append((time.perf_counter(), time.process_time(), collective_seconds[0]))
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stamps.append((time.perf_counter(), time.process_time(), collective_seconds[0]))
    facts = {
        "optimizer_state_bytes": optimizer_state_bytes(inner_optimizer(ds_optimizer)),
        "parameter_bytes": parameter_bytes(engine.module),
        "backend": gradient_backend(),
        "strategy": f"DeepSpeed ZeRO-{stage}",
    }
    dist.destroy_process_group()
    return losses, stamps, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=["accel", "raw"], required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    total = args.warmup + args.steps
    time_collectives()
    if args.runner == "accel":
        losses, stamps, facts = accel_training(total)
    else:
        losses, stamps, facts = raw_training(args.stage, total)
    (wall_start, cpu_start, comm_start), (wall_end, cpu_end, comm_end) = stamps[args.warmup], stamps[-1]
    report = {
        "steps_per_s": args.steps / (wall_end - wall_start),
        "cpu_ms_per_step": (cpu_end - cpu_start) / args.steps * 1e3,
        "collective_ms_per_step": (comm_end - comm_start) / args.steps * 1e3,
        "losses": losses,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **facts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
