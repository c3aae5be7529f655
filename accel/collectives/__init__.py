"""Cross-process collectives with HF Accelerate's semantics and their native fast paths."""

from accel.collectives.padding import pad_across_processes, pad_reference, pad_tensor

__all__ = ["pad_across_processes", "pad_reference", "pad_tensor"]
