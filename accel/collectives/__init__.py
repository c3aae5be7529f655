"""Cross-process collectives with HF Accelerate's semantics and their native fast paths."""

from accel.collectives.operations import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    gather_ragged,
    reduce,
    verify_operation,
)
from accel.collectives.padding import pad_across_processes, pad_reference, pad_tensor

__all__ = [
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "gather_ragged",
    "pad_across_processes",
    "pad_reference",
    "pad_tensor",
    "reduce",
    "verify_operation",
]
