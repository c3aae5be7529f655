"""`accelerate.utils.operations` import path: re-exports."""

from accel.collectives import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)
from accel.collectives.operations import verify_operation
from accel.collectives.pytree import get_shape

__all__ = [
    "DistributedOperationException", "broadcast", "broadcast_object_list", "concatenate", "find_batch_size",
    "gather", "gather_object", "get_shape", "pad_across_processes", "recursively_apply", "reduce",
    "send_to_device", "verify_operation",
]  # fmt: skip
