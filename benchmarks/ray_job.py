"""A training job of bench_training.py under Ray Train: TorchTrainer on 2 CPU workers, each running
training_job.train (accel's or HF Accelerate's `Accelerator` inside `train_loop_per_worker`, adopting Ray's group).

    python benchmarks/ray_job.py --library accel --workload gpt2 --steps 60 --out result.json

Ray is pinned to loopback as tests/integrations/test_ray_train.py pins it (accel.test_utils.ray_loopback; the caller
sets LOOPBACK_ENV); where Ray reports another address the job stops with an error instead of training. Ray's session
files go to a temporary folder removed afterwards.
"""

from __future__ import annotations

import os
import tempfile

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from training_job import parse_arguments, train

from accel.test_utils.ray_loopback import not_loopback, reported_addresses, start_ray


def _loop(config: dict) -> None:
    train(config["library"], config["workload"], config["steps"], config["warmup"], config["out"])


def main() -> None:
    args = parse_arguments(__doc__.splitlines()[0])
    with tempfile.TemporaryDirectory(prefix="accel-bench-ray-") as folder:
        start_ray(folder)
        try:
            wrong = not_loopback(reported_addresses())
            if wrong:
                raise SystemExit(f"Ray reports non-loopback addresses {wrong} despite the pinning; not training")
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
