"""accel.utils: the names users import from `accelerate.utils`, re-exported from where they live.

Names resolve on first use, so the CLI can import `accel.utils.config` without importing torch.
"""

import importlib

_PUBLIC = {
    "DistributedType": "accel.state",
    "pad_across_processes": "accel.collectives",
    "write_basic_config": "accel.utils.config",
}
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'accel.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
    return __all__
