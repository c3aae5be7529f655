"""`accelerate.utils.modeling`'s checkpoint names, as users import them (`from accel.utils.modeling import ...`)."""

from accel.big_modeling import (
    compute_module_sizes,
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
    named_module_tensors,
)
from accel.checkpoint import load_checkpoint_in_model

__all__ = [
    "compute_module_sizes", "convert_file_size_to_int", "get_balanced_memory", "get_max_memory",
    "infer_auto_device_map", "load_checkpoint_in_model", "named_module_tensors",
]  # fmt: skip
