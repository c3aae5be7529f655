"""Big-model inference: create a model without allocating its weights, then size it for placement.

So far: `init_empty_weights` / `init_on_device` (empty.py), `compute_module_sizes` (sizes.py), and device maps
(device_map.py: `get_max_memory`, `get_balanced_memory`, `infer_auto_device_map`). Dispatch with offload and
`load_checkpoint_and_dispatch` are not built yet.
"""

from accel.big_modeling.device_map import (
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from accel.big_modeling.empty import init_empty_weights, init_on_device
from accel.big_modeling.sizes import compute_module_sizes, named_module_tensors

__all__ = [
    "compute_module_sizes", "convert_file_size_to_int", "get_balanced_memory", "get_max_memory", "infer_auto_device_map",
    "init_empty_weights", "init_on_device", "named_module_tensors",
]  # fmt: skip
