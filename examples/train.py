"""A small real training run: an MLP learns a fixed random "teacher" network from noisy samples.

Run it on 2 CPU processes with:  accel launch --cpu --num_processes 2 examples/train.py
Each rank trains on its shard of every batch (DistributedSampler), gradients are averaged by DDP, and the
main process prints the mean loss over all ranks per epoch. It also runs as `python examples/train.py`.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accel.state import PartialState


def make_dataset(samples: int, features: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for param in teacher.parameters():  # unit-variance outputs, so the loss reads as a fraction of the signal
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
        inputs = torch.randn(samples, features, generator=generator)
        targets = teacher(inputs) + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def make_model(features: int) -> torch.nn.Module:
    torch.manual_seed(1)  # every rank starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def mean_over_ranks(state: PartialState, value: float) -> float:
    if not state.use_distributed:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / state.num_processes


def train_epoch(model, loader, optimizer, device) -> float:
    model.train()
    losses = []
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch size, split over the ranks")
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    state = PartialState()
    features = 16
    dataset = make_dataset(args.samples, features)
    sampler = DistributedSampler(dataset, state.num_processes, state.process_index, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size // state.num_processes, sampler=sampler)
    model = make_model(features).to(state.device)
    if state.use_distributed:
        device_ids = [state.device.index] if state.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    state.print(f"training on {state.num_processes} process(es) ({state.distributed_type}), {len(dataset)} samples")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss = mean_over_ranks(state, train_epoch(model, loader, optimizer, state.device))
        state.print(f"epoch {epoch}: loss {loss:.4f}")
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
