"""`accelerate.utils.operations` import path: re-exports."""

from accel.collectives import pad_across_processes

__all__ = ["pad_across_processes"]
