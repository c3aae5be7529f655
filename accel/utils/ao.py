"""`accelerate.utils.ao` import path: torchao FP8 helpers (accel runs no FP8 engine; see accel.backends.fp8)."""

from accel.backends.fp8 import (
    convert_model_to_fp8_ao,
    filter_first_and_last_linear_layers,
    filter_linear_layers,
    find_first_last_linear_layers,
    has_ao_layers,
)

__all__ = [
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
]
