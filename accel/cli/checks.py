"""The script `accel test` launches on every configured process.

Each check raises with its name on failure; the launcher then exits non-zero and shows which rank failed.
The main process prints one line per passed check and, at the end, the success line.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from accel.collectives import pad_across_processes
from accel.state import DistributedType, PartialState


class CheckFailed(RuntimeError):
    pass


def require(condition: bool, message: str) -> None:
    """Like assert, but not stripped by python -O."""
    if not condition:
        raise CheckFailed(message)


def all_gathered(state: PartialState, value: Any) -> list:
    values = [None] * state.num_processes
    if state.use_distributed:
        dist.all_gather_object(values, value)
    else:
        values = [value]
    return values


def check_process_state(state: PartialState) -> None:
    indices = all_gathered(state, state.process_index)
    require(indices == list(range(state.num_processes)), f"process indices {indices}")
    if state.num_processes == 1:
        expected = DistributedType.NO
    else:
        expected = DistributedType.MULTI_GPU if state.device.type == "cuda" else DistributedType.MULTI_CPU
    require(state.distributed_type == expected, f"distributed_type {state.distributed_type}, expected {expected}")
    state.wait_for_everyone()


def check_collectives(state: PartialState) -> None:
    rank, world = state.process_index, state.num_processes
    mine = torch.full((rank + 1, 3), float(rank), device=state.device)
    padded = pad_across_processes(mine, dim=0, pad_index=-1)
    require(padded.shape == (world, 3), f"pad_across_processes gave {tuple(padded.shape)}, expected ({world}, 3)")
    require((padded[: rank + 1] == rank).all() and (padded[rank + 1 :] == -1).all(), "padding values wrong")
    if state.use_distributed:
        total = torch.tensor([float(rank + 1)], device=state.device)
        dist.all_reduce(total)
        require(total.item() == world * (world + 1) / 2, f"all_reduce sum {total.item()}")
        token = torch.tensor([42.0 if rank == 0 else 0.0], device=state.device)
        dist.broadcast(token, src=0)
        require(token.item() == 42.0, "broadcast from rank 0 did not arrive")


def check_data_sharding(state: PartialState) -> None:
    samples = list(range(2 * state.num_processes + 1))
    with state.split_between_processes(samples) as mine:
        shards = all_gathered(state, list(mine))
    flat = [x for shard in shards for x in shard]
    require(flat == samples, f"split_between_processes shards {shards} do not partition {samples}")


def fit(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, steps: int = 20) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def check_training(state: PartialState) -> None:
    """DDP over each rank's shard of the data must end where one process on all the data ends."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(8 * state.num_processes, 4, generator=generator)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP would broadcast them
    reference = torch.nn.Linear(4, 1)
    distributed = torch.nn.Linear(4, 1).to(state.device)
    distributed.load_state_dict(reference.state_dict())
    fit(reference, inputs, targets)
    with state.split_between_processes(list(range(len(inputs)))) as rows:
        shard = torch.tensor(rows)
    wrapped = distributed
    if state.use_distributed:
        device_ids = [state.device.index] if state.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(distributed, device_ids=device_ids)
    fit(wrapped, inputs[shard].to(state.device), targets[shard].to(state.device))
    for name, param in distributed.named_parameters():
        ref = reference.get_parameter(name)
        require(
            torch.allclose(param.cpu(), ref, atol=1e-5), f"{name}: {param.tolist()} vs single process {ref.tolist()}"
        )


CHECKS = [
    ("process state", check_process_state),
    ("collectives", check_collectives),
    ("data sharding", check_data_sharding),
    ("training matches a single process", check_training),
]


def main() -> None:
    state = PartialState()
    state.print(f"accel test: {state.num_processes} process(es), {state.distributed_type}, device {state.device}")
    for name, check in CHECKS:
        try:
            check(state)
        except Exception as exc:
            raise RuntimeError(f"accel test: check '{name}' failed on rank {state.process_index}: {exc}") from exc
        state.print(f"  ok  {name}")
    state.wait_for_everyone()
    state.print("Test is a success! You are ready for your distributed training!")
    state.destroy_process_group()


if __name__ == "__main__":
    main()
