"""One rank of bench_hf_stack.py's wrapper benchmark: what each Accelerator call the `Trainer` (and TRL's
`SFTTrainer`) makes every optimizer step costs, against the torch call it stands for, on hf_stack_job.py's model.

    torchrun --nproc_per_node 2 benchmarks/hf_stack_wrappers.py --library accel --out result.json
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 benchmarks/hf_stack_wrappers.py --library accelerate --out r.json

Each call is timed in runs of `--calls` calls in a row, started together on both ranks, `--repeats` runs
alternating with runs of its torch counterpart. Rank 0 writes {"library", "calls": {name: {"wrapper_us",
"torch_us"}} (medians of the runs' µs per call), "per_step": PER_STEP (how often a step makes each call)}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import hf_stack_job as job
import torch
import torch.distributed as dist

# How many times one optimizer step of the `Trainer` (no gradient accumulation) makes each call, and TRL's
# `SFTTrainer` on top of it (its per-step metrics: 4 gather_for_metrics). transformers 5.25 / TRL 1.16.
PER_STEP = {
    "lm": {
        "_set_sync_gradients": 1,
        "dataloader next": 1,
        "gather": 1,
        "backward": 1,
        "clip_grad_norm_": 1,
        "optimizer.step": 1,
        "optimizer_step_was_skipped": 1,
    },
    "sft": {"gather_for_metrics": 4},
}


def per_call(call: Callable[[], object], calls: int) -> float:
    """Seconds per call over `calls` calls in a row, started together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def measure(pairs: dict[str, tuple[Callable, Callable | None]], calls: int, repeats: int) -> dict[str, dict]:
    """{name: {"wrapper_us", "torch_us"}}: medians over `repeats` runs of `calls` calls in a row, the wrapper's and
    the torch call's runs alternating (torch_us 0 where the wrapper stands for nothing torch does)."""
    results = {}
    for name, (wrapper, raw) in pairs.items():
        times = {"wrapper_us": [], "torch_us": []}
        for index in range(repeats):
            order = [("wrapper_us", wrapper), ("torch_us", raw)]
            for side, call in order if index % 2 == 0 else order[::-1]:
                times[side].append(0.0 if call is None else per_call(call, calls))
        results[name] = {side: statistics.median(values) * 1e6 for side, values in times.items()}
    return results


def cycling(loader) -> Callable[[], object]:
    """next() over `loader`, starting a new epoch when one ends."""
    state = {"it": iter(loader)}

    def next_batch():
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            return next(state["it"])

    return next_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=("accel", "accelerate"), required=True)
    parser.add_argument("--calls", type=int, default=50, help="calls in a row per timing")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from transformers import default_data_collator

    library = importlib.import_module(args.library)
    ddp_kwargs = library.DistributedDataParallelKwargs(find_unused_parameters=True)  # as the Trainer asks
    accelerator = library.Accelerator(cpu=True, kwargs_handlers=[ddp_kwargs])
    tok = job.tokenizer()
    blocks = job.packed_blocks(tok, job.corpus())
    model = job.model(tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.LEARNING_RATE, weight_decay=0.0, fused=True)
    loader = torch.utils.data.DataLoader(blocks, batch_size=job.BATCH, collate_fn=default_data_collator)
    model, optimizer, prepared_loader = accelerator.prepare(model, optimizer, loader)
    model(**next(iter(prepared_loader))).loss.backward()  # gradients for the clip and the optimizer
    leaf = torch.ones(4, requires_grad=True)
    count = torch.tensor(512)
    gathered = torch.empty(dist.get_world_size(), dtype=count.dtype)
    pairs = {
        "_set_sync_gradients": (lambda: accelerator.gradient_state._set_sync_gradients(True), None),
        "dataloader next": (cycling(prepared_loader), cycling(loader)),
        "gather": (lambda: accelerator.gather(count), lambda: dist.all_gather_into_tensor(gathered, count.reshape(1))),
        "gather_for_metrics": (
            lambda: accelerator.gather_for_metrics(count),
            lambda: dist.all_gather_into_tensor(gathered, count.reshape(1)),
        ),
        "backward": (lambda: accelerator.backward((leaf * 2).sum()), lambda: (leaf * 2).sum().backward()),
        "clip_grad_norm_": (
            lambda: accelerator.clip_grad_norm_(model.parameters(), job.MAX_GRAD_NORM),
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), job.MAX_GRAD_NORM),
        ),
        "optimizer.step": (optimizer.step, optimizer.optimizer.step),
        "optimizer_step_was_skipped": (lambda: accelerator.optimizer_step_was_skipped, None),
    }
    results = measure(pairs, args.calls, args.repeats)
    if dist.get_rank() == 0:
        report = {"library": type(accelerator).__module__, "calls": results, "per_step": PER_STEP}
        Path(args.out).write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
