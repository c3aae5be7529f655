"""Cross-process collectives with HF Accelerate's semantics and their native fast paths.

The names below resolve on first use: importing one module of the package (the process state imports the
uneven-step protocol, `accel.wire.uneven`) does not import the others.
"""

from accel._lazy import lazy_names

_PUBLIC = {
    "DistributedOperationException": "accel.errors",
    "broadcast": "accel.collectives.operations",
    "broadcast_object_list": "accel.collectives.operations",
    "gather": "accel.collectives.operations",
    "gather_object": "accel.collectives.operations",
    "gather_ragged": "accel.collectives.operations",
    "reduce": "accel.collectives.operations",
    "verify_operation": "accel.collectives.operations",
    "pad_across_processes": "accel.collectives.pad_across",
    "pad_reference": "accel.wire.padding",
    "pad_tensor": "accel.wire.padding",
}
__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)
