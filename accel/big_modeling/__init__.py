"""Big-model inference: create a model without allocating its weights, then size it for placement.

So far: `init_empty_weights` / `init_on_device` (empty.py) and `compute_module_sizes` (sizes.py). Device maps,
dispatch with offload and `load_checkpoint_and_dispatch` are not built yet.
"""

from accel.big_modeling.empty import init_empty_weights, init_on_device
from accel.big_modeling.sizes import compute_module_sizes, named_module_tensors

__all__ = ["compute_module_sizes", "init_empty_weights", "init_on_device", "named_module_tensors"]
