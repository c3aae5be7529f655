"""An Accelerator inside Ray Train: TorchTrainer starts the workers and their process group, accel adopts it.

Ray Train's `TorchTrainer` starts one worker process per `num_workers`, sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, ... in each and initializes torch.distributed itself (gloo on CPU workers). `Accelerator()` inside
`train_loop_per_worker` adopts that group: same ranks, same store, and on one host its CPU collectives go through
accel's shared memory instead of TCP (README: "More than one machine"). `prepare` shards the data per worker, and
each epoch's `save_state` folder is handed to `ray.train.report`, which copies it into the run's storage.

    pip install 'accel[ray]'
    python examples/ray_train.py                       # 2 CPU workers on a local Ray instance ray.init() starts
    python examples/ray_train.py --num_workers 4 --storage_path /shared/ray_results   # on a running Ray cluster
"""

import argparse
import shutil
import tempfile

import ray.train
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator  # the only difference from HF Accelerate: `from accelerate import Accelerator`
from accel.utils import broadcast_object_list


def make_dataset(samples: int = 512, features: int = 8, seed: int = 0) -> TensorDataset:
    """A noisy linear regression problem, the same on every worker (each sees its shard once prepared)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    weights = torch.randn(features, 1, generator=generator)
    return TensorDataset(inputs, inputs @ weights + 0.05 * torch.randn(samples, 1, generator=generator))


def save_and_report(accelerator: Accelerator, metrics: dict) -> None:
    """Saves the whole training state and hands it to Ray Train.

    Every process saves into one folder named by the main process (created on the other hosts by their processes):
    the main process writes the model, optimizer, ... files, every process its own RNG file. Each host's first
    process reports its host's copy, and Ray Train merges what the workers report into one checkpoint of the run's
    storage (the names never collide); then the folder is removed. `ray.train.report` is collective: every worker
    calls it, with or without a checkpoint.
    """
    folder = tempfile.mkdtemp(prefix="accel-ray-") if accelerator.is_main_process else None
    folder = broadcast_object_list([folder])[0]
    accelerator.save_state(folder)
    checkpoint = Checkpoint.from_directory(folder) if accelerator.is_local_main_process else None
    ray.train.report(metrics, checkpoint=checkpoint)
    accelerator.wait_for_everyone()  # every host's report has copied the folder
    if accelerator.is_local_main_process:
        shutil.rmtree(folder, ignore_errors=True)


def train_loop_per_worker(config: dict) -> None:
    """What each Ray Train worker runs: an ordinary accel training loop."""
    accelerator = Accelerator()  # adopts the process group TorchTrainer initialized
    torch.manual_seed(0)  # the same initial weights on every worker (DDP checks it)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    loader = DataLoader(make_dataset(), batch_size=config["batch_size"], shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(config["epochs"]):
        total, batches = torch.zeros(()), 0
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total, batches = total + loss.detach(), batches + 1
        mean_loss = accelerator.reduce(total / batches, reduction="mean").item()
        save_and_report(accelerator, {"epoch": epoch, "loss": mean_loss})


def build_trainer(
    num_workers: int, epochs: int, storage_path: str | None, loop=train_loop_per_worker, **config
) -> TorchTrainer:
    """A TorchTrainer of `num_workers` CPU workers running `loop` (its config: epochs, batch size, learning rate, and
    any `config` entries); checkpoints go to `storage_path` (Ray's default, ~/ray_results, when None)."""
    return TorchTrainer(
        loop,
        train_loop_config={"epochs": epochs, "batch_size": 32, "lr": 0.1, **config},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False),
        run_config=RunConfig(name="accel_ray_train", storage_path=storage_path),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage_path", default=None, help="where Ray Train keeps the run's checkpoints")
    args = parser.parse_args()
    result = build_trainer(args.num_workers, args.epochs, args.storage_path).fit()
    print(f"final loss {result.metrics['loss']:.4f}; checkpoint in {result.checkpoint.path}")


if __name__ == "__main__":
    main()
