"""A small real training run, written for HF Accelerate: only the import line names accel.

An MLP learns a fixed random "teacher" network from noisy samples, with gradient accumulation, gradient
clipping, a learning rate schedule and an evaluation pass whose metric sees every sample exactly once
(gather_for_metrics).

    accel launch --cpu --num_processes 2 examples/train.py
    accel launch --cpu --num_processes 2 --mixed_precision fp16 examples/train.py   # real fp16 on the CPU
    accel launch --cpu --num_processes 2 --use_fsdp examples/train.py    # sharded with FSDP2 (HF refuses this)
    python examples/train.py                           # one process
    accelerate launch --cpu examples/train.py          # HF Accelerate, after changing the import back
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator  # the only difference from HF Accelerate: `from accelerate import Accelerator`


def make_dataset(samples, features, seed):
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for param in teacher.parameters():  # unit-variance outputs, so the loss reads as a fraction of the signal
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
        inputs = torch.randn(samples, features, generator=generator)
        targets = teacher(inputs) + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def evaluate(accelerator, model, loader):
    model.eval()
    squared_error, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            predictions, targets = accelerator.gather_for_metrics((model(inputs), targets))
            squared_error += torch.nn.functional.mse_loss(predictions, targets, reduction="sum").item()
            count += len(targets)
    return squared_error / count, count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=32, help="per process")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(1)  # every process builds the same initial weights
    features = 16
    train_loader = DataLoader(make_dataset(args.samples, features, seed=0), batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(
        make_dataset(1001, features, seed=0), batch_size=args.batch_size
    )  # 1001: uneven on purpose
    model = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    compute_dtypes = set()  # what the first layer computes in: float16 under fp16 autocast, on the CPU too
    model[0].register_forward_hook(lambda module, inputs, output: compute_dtypes.add(output.dtype))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    accelerator.print(
        f"training on {accelerator.num_processes} process(es) ({accelerator.distributed_type}), "
        f"mixed precision {accelerator.mixed_precision}, {len(train_loader.dataset)} samples"
    )
    for epoch in range(args.epochs):
        model.train()
        total, batches, skipped = 0.0, 0, 0
        for inputs, targets in train_loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                skipped += accelerator.sync_gradients and accelerator.optimizer_step_was_skipped
                scheduler.step()
                optimizer.zero_grad()
            total, batches = total + loss.item(), batches + 1
        train_loss = accelerator.reduce(torch.tensor(total / batches, device=accelerator.device), "mean").item()
        eval_mse, seen = evaluate(accelerator, model, eval_loader)
        accelerator.print(f"epoch {epoch}: loss {train_loss:.4f}, eval mse {eval_mse:.4f} over {seen} samples")
        if accelerator.scaler is not None:  # fp16: the loss scale, and the steps skipped for inf/nan gradients
            accelerator.print(
                f"  loss scale {accelerator.scaler.get_scale():g}, {skipped} step(s) skipped, "
                f"first layer computes in {sorted(map(str, compute_dtypes))}"
            )
    accelerator.print(f"final loss {train_loss:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
