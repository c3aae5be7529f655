"""`accelerate.utils.random` import path: re-exports of accel.data's seeding and RNG synchronization."""

from accel.availability import (
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)
from accel.data import RNGType, set_seed, synchronize_rng_state, synchronize_rng_states
from accel.state import AcceleratorState, DistributedType

__all__ = [name for name in dir() if not name.startswith("_")]
