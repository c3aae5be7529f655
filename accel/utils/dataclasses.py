"""`accelerate.utils.dataclasses` import path: re-exports."""

from accel.state import DistributedType

__all__ = ["DistributedType"]
