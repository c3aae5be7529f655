"""One rank of a training job timed by bench_training.py: the same script under accel or HF Accelerate.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/training_job.py \\
        --library accel --workload gpt2 --steps 40 --out result.json

Workloads: `mlp` (examples/train.py's loop: gradient accumulation, clipping, a schedule), `gpt2` (the tests' tiny
GPT-2 from transformers, tests/test_transformers.py) and `fsdp2` (torch's fully_shard on the group the library's
PartialState starts; with ACCEL_TRANSPORT=torch that group is plain gloo). After `--warmup` untimed steps, rank 0
times `--steps` steps and writes {"steps_per_s", "losses", "shared_memory"} to `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch
import torch.distributed as dist

BATCH, FEATURES, SEQUENCE = 32, 16, 32


def mlp_setup(library, accelerator):
    torch.manual_seed(0)  # the libraries' set-up may have drawn from the global generator: start from a known state
    generator = torch.Generator().manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    inputs = torch.randn(8192, FEATURES, generator=generator)
    with torch.no_grad():
        targets = teacher(inputs)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=BATCH)
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def step(batch):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        return loss

    return loader, step


def gpt2_setup(library, accelerator):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=SEQUENCE)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 97, (4096, SEQUENCE), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def step(batch):
        loss = model(input_ids=batch[0], labels=batch[0]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return loader, step


def fsdp2_setup(library, accelerator):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[layer for _ in range(4) for layer in (torch.nn.Linear(256, 256), torch.nn.ReLU())], torch.nn.Linear(256, 1)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [
        (torch.randn(BATCH, 256, generator=generator), torch.randn(BATCH, 1, generator=generator)) for _ in range(64)
    ]

    def step(batch):
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return batches, step


WORKLOADS = {"mlp": mlp_setup, "gpt2": gpt2_setup, "fsdp2": fsdp2_setup}


def batches(loader, count: int):
    """`count` batches, cycling through the loader."""
    produced = 0
    while True:
        for batch in loader:
            yield batch
            produced += 1
            if produced == count:
                return


def train(library_name: str, workload: str, steps: int, warmup: int, out: str) -> None:
    """This rank's part of the job; rank 0 writes the report to `out`. Leaves the process group as it is."""
    library = importlib.import_module("accel" if library_name == "accel" else "accelerate")
    accelerator = library.Accelerator(cpu=True)
    loader, step = WORKLOADS[workload](library, accelerator)
    losses, started = [], None
    for index, batch in enumerate(batches(loader, warmup + steps)):
        if index == warmup:
            dist.barrier()
            started = time.perf_counter()
        losses.append(step(batch).item())
    elapsed = time.perf_counter() - started
    backend = dist.group.WORLD._get_backend(torch.device("cpu")).name()
    if dist.get_rank() == 0:
        with open(out, "w") as file:
            json.dump({"steps_per_s": steps / elapsed, "losses": losses, "shared_memory": backend == "accel"}, file)
    accelerator.wait_for_everyone()


def parse_arguments(description: str) -> argparse.Namespace:
    """The job's options (this script's, and benchmarks/ray_job.py's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--library", choices=("accel", "hf"), required=True)
    parser.add_argument("--workload", choices=list(WORKLOADS), required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_arguments(__doc__.splitlines()[0])
    train(args.library, args.workload, args.steps, args.warmup, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
