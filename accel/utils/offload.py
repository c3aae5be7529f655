"""`accelerate.utils.offload`'s names, as users import them (`from accel.utils.offload import ...`).

The offload folder (HF's format) lives in accel.big_modeling.offload.
"""

from accel.big_modeling.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]
