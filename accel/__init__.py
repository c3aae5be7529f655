"""accel: HF Accelerate's API with a native core. The public names, nothing else.

Names resolve on first use, so `accel config` and `accel env` start without importing torch.
"""

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Accelerator": "accel.accelerator",
    "AcceleratorState": "accel.state",
    "DistributedType": "accel.state",
    "GradientState": "accel.state",
    "PartialState": "accel.state",
    "debug_launcher": "accel.launchers",
    "find_executable_batch_size": "accel.memory",
    "init_empty_weights": "accel.big_modeling",
    "init_on_device": "accel.big_modeling",
    "infer_auto_device_map": "accel.big_modeling",
    "notebook_launcher": "accel.launchers",
    "skip_first_batches": "accel.data",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
    return __all__
