"""Checkpoints on disk: safetensors files (safetensors_io.py) and model weights in Hugging Face's layout
(model_io.py: save_model's sharding and index, load_checkpoint_in_model)."""

from accel.checkpoint.model_io import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    load_checkpoint_in_model,
    parse_size,
    save_state_dict,
    split_into_shards,
)
from accel.checkpoint.safetensors_io import CheckpointError, load_file, read_header, save_file
from accel.checkpoint.state import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
)

# HF Accelerate's patterns for (sharded) weight file names: `{suffix}` is "" for one file, "-00001-of-00003" for
# the first of three shards.
SAFE_WEIGHTS_PATTERN_NAME = SAFE_MODEL_NAME + "{suffix}.safetensors"
WEIGHTS_PATTERN_NAME = MODEL_NAME + "{suffix}.bin"

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "CheckpointError",
    "MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAMPLER_NAME", "SCALER_NAME",
    "SCHEDULER_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "WEIGHTS_PATTERN_NAME",
    "load_checkpoint_in_model", "load_file", "parse_size", "read_header", "save_file", "save_state_dict",
    "split_into_shards",
]  # fmt: skip
