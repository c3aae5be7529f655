"""A training job of bench_training.py under Ray Train: TorchTrainer on 2 CPU workers, each running
training_job.train (accel's or HF Accelerate's `Accelerator` inside `train_loop_per_worker`, adopting Ray's group).

    python benchmarks/ray_job.py --library accel --workload gpt2 --steps 60 --out result.json

Ray is pinned to 127.0.0.1 as tests/integrations/test_ray_train.py pins it (the caller sets
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and GLOO_SOCKET_IFNAME=lo); where Ray reports another address the job stops
with an error instead of training. Ray's session files go to a temporary folder removed afterwards.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from training_job import parse_arguments, train


def _loop(config: dict) -> None:
    train(config["library"], config["workload"], config["steps"], config["warmup"], config["out"])


def _loopback_only() -> None:
    gcs_host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    addresses = [ray.util.get_node_ip_address(), gcs_host, *(node["NodeManagerAddress"] for node in ray.nodes())]
    wrong = [address for address in addresses if not ipaddress.ip_address(address.strip("[]")).is_loopback]
    if wrong:
        raise SystemExit(f"Ray reports non-loopback addresses {wrong} despite the pinning; not training")


def main() -> None:
    args = parse_arguments(__doc__.splitlines()[0])
    with tempfile.TemporaryDirectory(prefix="accel-bench-ray-") as folder:
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            _temp_dir=os.path.join(folder, "ray"),
            num_cpus=2,
            log_to_driver=False,
        )
        try:
            _loopback_only()
            config = dict(vars(args), out=os.path.abspath(args.out))
            TorchTrainer(
                _loop,
                train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(storage_path=os.path.join(folder, "storage")),
            ).fit()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
