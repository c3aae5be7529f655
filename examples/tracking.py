"""Experiment tracking, written as HF Accelerate's `examples/by_feature/tracking.py`: only the import names accel.

An MLP learns to classify samples labelled by a fixed random "teacher" network. With `--with_tracking` every
installed tracker (log_with="all": TensorBoard, wandb, mlflow, ... and accel's dependency-free jsonl tracker) records
the configuration, the training loss and learning rate every `--log_every` optimizer steps, and the evaluation
accuracy and loss after each epoch, under `--project_dir`. Then draw the curves:

    accel launch --cpu --num_processes 2 examples/tracking.py --with_tracking --project_dir logs
    accel plot logs -o logs/tracking.png
    tensorboard --logdir logs                     # the same run in TensorBoard, if installed
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator  # the only difference from HF Accelerate: `from accelerate import Accelerator`

CLASSES, FEATURES = 4, 16


def make_dataset(samples, seed):
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))  # the same for every split
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        inputs = torch.randn(samples, FEATURES, generator=generator)
        labels = (inputs @ teacher + 0.5 * torch.randn(samples, CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(inputs, labels)


def evaluate(accelerator, model, loader):
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    with torch.no_grad():
        for inputs, labels in loader:
            logits, labels = accelerator.gather_for_metrics((model(inputs), labels))
            correct += (logits.argmax(dim=1) == labels).sum().item()
            loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            count += len(labels)
    return correct / count, loss_sum / count


def training_function(config, args):
    # New code: log_with="all" picks every installed tracker; project_dir is where TensorBoard and jsonl write.
    if args.with_tracking:
        accelerator = Accelerator(cpu=args.cpu, log_with=args.log_with.split(","), project_dir=args.project_dir)
    else:
        accelerator = Accelerator(cpu=args.cpu)
    torch.manual_seed(config["seed"])  # every process builds the same initial weights
    train_loader = DataLoader(make_dataset(2048, seed=0), batch_size=config["batch_size"], shuffle=True)
    eval_loader = DataLoader(make_dataset(1001, seed=1), batch_size=config["batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["num_epochs"] * len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    # New code: start the runs and store the configuration (on the main process; no is_main_process check needed).
    if args.with_tracking:
        run = os.path.split(__file__)[-1].split(".")[0]
        accelerator.init_trackers(run, config)

    step = 0
    for epoch in range(config["num_epochs"]):
        model.train()
        for inputs, labels in train_loader:
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0:
                mean_loss = accelerator.reduce(loss.detach(), "mean").item()  # every process takes part
                if args.with_tracking:
                    accelerator.log({"train_loss": mean_loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        accuracy, eval_loss = evaluate(accelerator, model, eval_loader)
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.4f}, eval loss {eval_loss:.4f}")
        # New code: log the epoch's metrics; values may be int, float, str or a dict of numbers.
        if args.with_tracking:
            accelerator.log({"accuracy": accuracy, "eval_loss": eval_loss, "epoch": epoch}, step=step)

    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--with_tracking", action="store_true", help="log to every installed tracker")
    parser.add_argument("--log_with", default="all", help='trackers, comma-separated (default: "all" installed ones)')
    parser.add_argument("--project_dir", default="logs", help="where trackers that write files put them")
    parser.add_argument("--log_every", type=int, default=4, help="optimizer steps between training-loss logs")
    parser.add_argument("--num_epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 32}
    training_function(config, args)


if __name__ == "__main__":
    main()
