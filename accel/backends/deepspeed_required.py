"""HF's `deepspeed_required` decorator (a module of its own: it reads the process state, which imports
accel.backends.deepspeed)."""

from __future__ import annotations

import functools
from typing import Callable


def deepspeed_required(func: Callable) -> Callable:
    """Decorator: calling `func` once an `Accelerator` runs without DeepSpeed raises ValueError (as in HF). Before
    an Accelerator exists, `func` is called."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from accel.state import AcceleratorState, DistributedType, is_initialized  # (imports torch: not at import)

        if is_initialized() and AcceleratorState().distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(
                "DeepSpeed is not enabled, please make sure that an `Accelerator` is configured for `deepspeed` "
                "before calling this function."
            )
        return func(*args, **kwargs)

    return wrapper


__all__ = ["deepspeed_required"]
