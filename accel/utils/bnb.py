"""`accelerate.utils.bnb` import path (accel does not quantize; see accel.backends.bnb)."""

from accel.backends.bnb import (
    has_4bit_bnb_layers,
    load_and_quantize_model,
)

__all__ = ["has_4bit_bnb_layers", "load_and_quantize_model"]
