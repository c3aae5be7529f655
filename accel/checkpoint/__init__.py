"""Checkpoints on disk: safetensors files (safetensors_io.py), model weights in Hugging Face's layout
(model_io.py: save_model's sharding and index, load_checkpoint_in_model), a training run's whole state
(training_state.py: save_state / load_state), how a checkpoint folder is staged, published and rotated
(publish.py), the three save modes and durability (background.py, snapshot.py), the file names (names.py),
atomically replaced files (atomic_files.py) and lease-guarded mapped weights (leased_mapping.py)."""

from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.model_io import load_checkpoint_in_model, parse_size, save_state_dict, split_into_shards
from accel.checkpoint.names import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)
from accel.checkpoint.safetensors_io import CheckpointError, load_file, read_header, save_file

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "WEIGHTS_PATTERN_NAME",
    "load_checkpoint_in_model",
    "load_file",
    "parse_size",
    "read_header",
    "save_file",
    "save_state_dict",
    "split_into_shards",
    "write_atomically",
]
