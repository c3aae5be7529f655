"""How accel names objects and sizes in messages (HF Accelerate's `get_pretty_name`, `convert_bytes`)."""

from __future__ import annotations

from typing import Any

_UNITS = ("bytes", "KB", "MB", "GB", "TB")


def get_pretty_name(obj: Any) -> str:
    """The qualified name of `obj` if it has one (a class, a function), else that of its class.

    Example::

        get_pretty_name(torch.optim.AdamW)              # "AdamW"
        get_pretty_name(torch.nn.Linear(2, 2))          # "Linear"
    """
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    if hasattr(obj, "__qualname__"):
        return obj.__qualname__
    if hasattr(obj, "__name__"):
        return obj.__name__
    return str(obj)


def convert_bytes(size: float) -> str:
    """`size` bytes in the largest binary unit below 1024 of it, rounded to 2 decimals.

    The units are powers of 1024 written as HF Accelerate writes them ("KB" for 1024 bytes).

    Example::

        convert_bytes(1536)       # "1.5 KB"
        convert_bytes(3 * 2**40)  # "3.0 TB"
    """
    for unit in _UNITS:
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"
