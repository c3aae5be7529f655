"""`accelerate.parallelism_config` import path: `ParallelismConfig` (see accel.backends.parallelism)."""

from accel.backends.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
