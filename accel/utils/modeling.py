"""`accelerate.utils.modeling`'s checkpoint names, as users import them (`from accel.utils.modeling import ...`)."""

from accel.checkpoint import load_checkpoint_in_model

__all__ = ["load_checkpoint_in_model"]
