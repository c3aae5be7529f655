"""The backends HF Accelerate runs and accel does not: DeepSpeed, FSDP, Megatron-LM, FP8 engines, bitsandbytes,
TPU/XLA, tensor/context/sequence parallelism.

Their configuration classes and helpers keep HF Accelerate's names, fields, defaults and environment variables,
so scripts import and configs load. Building a configuration is harmless and works; *using* a backend (passing
its plugin to `Accelerator`, calling a function that needs its engine) raises
`accel.unsupported.UnsupportedFeatureError`, naming the feature, what asked for it and what accel runs instead.
Helpers that make sense without the engine (environment toggles, module inspection, name canonicalization) work.

One module per backend: deepspeed, fsdp, megatron, fp8 (TransformerEngine, MS-AMP, torchao), bnb, xla,
parallelism; `checks` refuses them at `Accelerator(...)`.
"""

from __future__ import annotations

import os

from accel._env import parse_bool

DDP_INSTEAD = (
    "accel runs DDP on CPUs and GPUs (`accel launch --num_processes N`, or --multi_gpu) with mixed_precision "
    "'no', 'bf16' or 'fp16'."
)


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable `name` (exactly that name: FSDP_*, MEGATRON_LM_*, PARALLELISM_CONFIG_*
    are read unprefixed, as HF Accelerate's launcher exports them); unset or empty means `default`."""
    value = os.environ.get(name)
    return default if value is None or not value.strip() else parse_bool(value, name)
