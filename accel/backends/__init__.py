"""HF Accelerate's backends, one module each, with their configuration classes and helpers under HF's names, fields,
defaults and environment variables, so scripts import and configs load.

Two run: fsdp (`FullyShardedDataParallelPlugin`, trained by `accel.strategies.fsdp2` on torch's `fully_shard`;
fsdp_options holds its launch options and the FSDP1 -> FSDP2 translation) and deepspeed (`DeepSpeedPlugin` and
`HfDeepSpeedConfig`, trained by `accel.strategies.deepspeed` on DeepSpeed's engine); parallelism's
`ParallelismConfig` runs its data-parallel sizes. The rest are refused: megatron, fp8 (TransformerEngine, MS-AMP,
torchao), bnb, xla, and tensor/context/sequence parallelism. Building their configurations is harmless; *using* one
(passing its plugin to `Accelerator`, calling a function that needs its engine) raises
`accel.unsupported.UnsupportedFeatureError`, naming the feature, what asked for it and what accel runs instead;
`checks` refuses them at `Accelerator(...)`. Helpers that make sense without the engine (environment toggles, module
inspection, name canonicalization) work.
"""

from __future__ import annotations

import os

from accel.env_vars import parse_bool

DDP_INSTEAD = (
    "accel runs DDP on CPUs and GPUs (`accel launch --num_processes N`, or --multi_gpu) with mixed_precision "
    "'no', 'bf16' or 'fp16'."
)


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable `name` (exactly that name: FSDP_*, MEGATRON_LM_*, PARALLELISM_CONFIG_*
    are read unprefixed, as HF Accelerate's launcher exports them); unset or empty means `default`."""
    value = os.environ.get(name)
    return default if value is None or not value.strip() else parse_bool(value, name)
