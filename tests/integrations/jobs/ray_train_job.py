"""examples/ray_train.py's loop under Ray Train on 2 CPU workers, pinned to loopback, observed from every worker.

    python ray_train_job.py FOLDER     (examples/ on PYTHONPATH; tests/integrations/test_ray_train.py runs it)

Starts a local Ray instance (its session files under FOLDER/ray, the run's storage under FOLDER/storage) pinned to
127.0.0.1, and checks that before any training: where Ray reports another address it prints {"skip": why} and stops.
Each worker records what it sees around the example's `train_loop_per_worker` (MASTER_ADDR, the group Ray made, its
CPU backend before and after the Accelerator, its local rank, the samples its prepared dataloader yields) in
FOLDER/facts/RANK.json. The last line printed is one JSON object: the addresses, every worker's facts, the reported
metrics and the reported checkpoint's files and loss.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import time

import ray
import ray_train  # examples/ray_train.py
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from accel.test_utils.ray_loopback import not_loopback, reported_addresses, start_ray

DATASET_SIZE = 24  # the observed dataloader: 24 indices, 12 per worker


def _cpu_backend_name() -> str:
    return dist.group.WORLD._get_backend(torch.device("cpu")).name()


def observed_loop(config: dict) -> None:
    """The example's loop, with what this worker saw before and after it written to config["facts"]/RANK.json."""
    from torch.utils.data import DataLoader

    from accel import Accelerator

    facts = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
        "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
        "group_before_accel": dist.is_initialized(),
        "backend_before": _cpu_backend_name() if dist.is_initialized() else None,
    }
    if not ipaddress.ip_address(facts["MASTER_ADDR"]).is_loopback:  # Ray's group is up already: say so, train not
        raise RuntimeError(f"MASTER_ADDR={facts['MASTER_ADDR']} is not a loopback address")
    ray_train.train_loop_per_worker(config)
    accelerator = Accelerator()  # the loop's, shared (a singleton state)
    loader = accelerator.prepare(DataLoader(list(range(DATASET_SIZE)), batch_size=4))
    facts.update(
        backend_after=_cpu_backend_name(),
        rank=accelerator.process_index,
        num_processes=accelerator.num_processes,
        local_process_index=accelerator.local_process_index,
        samples=[int(index) for batch in loader for index in batch],
    )
    with open(os.path.join(config["facts"], f"{accelerator.process_index}.json"), "w") as file:
        json.dump(facts, file)


def _checkpoint_summary(path: str) -> dict:
    """The reported checkpoint's files and the loss of its weights on the example's whole dataset."""
    weights = load_file(os.path.join(path, "model.safetensors"))
    inputs, targets = ray_train.make_dataset().tensors
    loss = torch.nn.functional.mse_loss(inputs @ weights["weight"].T + weights["bias"], targets).item()
    return {"files": sorted(os.listdir(path)), "keys": sorted(weights), "loss": loss}


def main(folder: str) -> dict:
    started = time.monotonic()
    facts = os.path.join(folder, "facts")
    os.makedirs(facts)
    start_ray(folder)  # pinned to loopback; the check below verifies it (LOOPBACK_ENV is set by the test)
    try:
        addresses = reported_addresses()
        wrong = not_loopback(addresses)
        if wrong:
            return {"skip": f"Ray reports non-loopback addresses {wrong} despite the pinning; not training"}
        trainer = ray_train.build_trainer(
            2, epochs=2, storage_path=os.path.join(folder, "storage"), loop=observed_loop, facts=facts
        )
        result = trainer.fit()
        workers = [json.load(open(os.path.join(facts, name))) for name in sorted(os.listdir(facts))]
        return {
            "addresses": addresses,
            "workers": workers,
            "metrics": result.metrics,
            "checkpoint": _checkpoint_summary(result.checkpoint.path),
            "fit_s": time.monotonic() - started,
        }
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
