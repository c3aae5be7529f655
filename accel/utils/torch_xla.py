"""`accelerate.utils.torch_xla` import path (accel runs no TPU/XLA; see accel.backends.xla)."""

from accel.backends.xla import (
    install_xla,
)

__all__ = ["install_xla"]
