"""`accelerate.utils.transformer_engine` import path (accel runs no FP8 engine; see accel.backends.fp8)."""

from accel.backends.fp8 import (
    apply_fp8_autowrap,
    contextual_fp8_autocast,
    convert_model,
    has_transformer_engine_layers,
)

__all__ = ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model", "has_transformer_engine_layers"]
