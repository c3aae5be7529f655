"""`accelerate.utils.memory` import path: re-exports (every public name of HF's module)."""

from accel.availability import (
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_xpu_available,
)
from accel.memory import clear_device_cache, find_executable_batch_size, release_memory, should_reduce_batch_size

__all__ = [name for name in dir() if not name.startswith("_")]
