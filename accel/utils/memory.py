"""`accelerate.utils.memory` import path: re-exports."""

from accel.memory import clear_device_cache, find_executable_batch_size, release_memory, should_reduce_batch_size

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
