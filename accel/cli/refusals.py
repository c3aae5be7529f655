"""What accel says when a launch flag, a config file or a subcommand asks for a backend it does not run.

One table, used by `accel launch`'s flags (launch_options.py), the config file's `distributed_type` and nested
configs (config_file.py) and `accel tpu-config`, so the same request gets the same answer wherever it comes from.
Torch-free: the CLI refuses before anything heavy is imported.
"""

from __future__ import annotations

from typing import NamedTuple

from accel.backends import DDP_INSTEAD
from accel.unsupported import UnsupportedFeatureError, refuse

_DDP = DDP_INSTEAD  # the same words at `accel launch` as at `Accelerator(...)`


class Backend(NamedTuple):
    feature: str
    instead: str


BACKENDS = {
    "deepspeed_multinode": Backend(
        "Starting DeepSpeed's machines with its own launcher (pdsh, openmpi, mvapich, mpich, nossh, slurm) and its "
        "hostfile or filters",
        "accel starts every machine through torch.distributed.run (HF's `--deepspeed_multinode_launcher standard`): "
        "run `accel launch --use_deepspeed --num_machines N --machine_rank R --main_process_ip IP ...` on each "
        "machine.",
    ),
    "megatron_lm": Backend("Megatron-LM", _DDP),
    "parallelism_config": Backend(
        "Tensor, context and sequence parallelism (parallelism config sizes tp_size, cp_size, sp_size above 1)", _DDP
    ),
    "fp8": Backend("FP8 training (TransformerEngine, MS-AMP, torchao)", "Use `--mixed_precision bf16` or `fp16`."),
    "tpu": Backend("TPU / XLA training", "accel runs on CPUs and CUDA GPUs (`--cpu`, `--multi_gpu`)."),
    "tpu_pod": Backend(
        "Running on TPU pods", "accel runs on CPUs and CUDA GPUs; start `accel launch` on each machine."
    ),
    "sagemaker": Backend(
        "Launching on Amazon SageMaker",
        "Start `accel launch --num_machines N --machine_rank R --main_process_ip IP` on each machine instead.",
    ),
    "mpirun": Backend(
        "Launching through mpirun",
        "accel launches through torch.distributed.run: start `accel launch --num_machines N --machine_rank R "
        "--main_process_ip IP` on each machine.",
    ),
    "other_devices": Backend(
        "Training on accelerators other than CUDA GPUs (NPU, MLU, SDAA, MUSA, XPU, HPU, Neuron)",
        "accel runs on CPUs and CUDA GPUs (`distributed_type: MULTI_CPU` or `MULTI_GPU`).",
    ),
}

# The backend each `distributed_type` accel does not run stands for.
DISTRIBUTED_TYPE_BACKENDS = {
    "MEGATRON_LM": "megatron_lm",
    "XLA": "tpu",
    **{
        kind: "other_devices"
        for kind in ("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
    },
}


def refuse_backend(backend: str, asked_by: str) -> UnsupportedFeatureError:
    """The error for `backend` (a key of BACKENDS), naming the flag, key or variable that asked for it."""
    feature, instead = BACKENDS[backend]
    return refuse(feature, asked_by, instead)
