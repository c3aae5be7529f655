"""Surviving out-of-memory errors: retry with a smaller batch (`find_executable_batch_size`) and free cached memory.

Out-of-memory is recognised by type (`torch.OutOfMemoryError`, which CUDA, XPU and MPS raise) or by the messages
the allocators put in a plain `RuntimeError` (cuDNN, the CPU allocator, older builds).
"""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Any, Callable

import torch

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP and XPU
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's answer to a workspace it cannot allocate
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Returns the CUDA caching allocator's unused blocks to the driver; with `garbage_collection`, runs
    `gc.collect()` first (slow: use it sparingly). Does nothing for CUDA if CUDA was never initialized."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drops this function's references to `objects`, collects garbage and empties the CUDA cache.

    Only the caller can drop its own references: assign the result back to the same names.

    Returns:
        A list of as many `None` as `objects`.

    Example:
        ```python
        model, optimizer = release_memory(model, optimizer)
        ```
    """
    released = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` says that memory ran out (so that a smaller batch may fit).

    True for `torch.OutOfMemoryError` and for a `RuntimeError` whose message is one of the allocators' (CUDA/XPU
    " out of memory.", cuDNN's CUDNN_STATUS_NOT_SUPPORTED / ALLOC_FAILED, the CPU allocator's "can't allocate
    memory" / "not enough memory", HPU's PT_DEVMEM).
    """
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


def _batch_size_parameter(function: Callable) -> inspect.Parameter:
    """The parameter that receives the batch size: the first positional one."""
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in _POSITIONAL or parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return parameter
    raise TypeError(
        f"`{function.__name__}` takes no positional parameter; `find_executable_batch_size` passes the batch size "
        f"as its first argument: `def {function.__name__}(batch_size, ...)`."
    )


def _check_call(function: Callable, batch_size_parameter: inspect.Parameter, args: tuple, kwargs: dict) -> None:
    """Raises when the caller passed the batch size itself (the decorator supplies it)."""
    parameters = inspect.signature(function).parameters.values()
    positional = [p.name for p in parameters if p.kind in _POSITIONAL]
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    passed_batch_size = batch_size_parameter.name in kwargs and batch_size_parameter.kind in _POSITIONAL
    if passed_batch_size or (not takes_varargs and len(args) + 1 > len(positional)):
        arg_str = ", ".join(f"{name}={value!r}" for name, value in zip(positional[1:], args[1:]))
        raise TypeError(
            f"Batch size was passed into `{function.__name__}` as the first argument when called. "
            f"Remove this as the decorator already does so: `{function.__name__}({arg_str})`"
        )


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
):
    """Decorator: calls `function(batch_size, *args, **kwargs)`, shrinking `batch_size` by a tenth after each
    out-of-memory error (HF Accelerate's documented default).

    `function` takes the batch size as its first argument; its callers leave it out. Before each attempt garbage is
    collected and the CUDA cache emptied. Errors that are not out-of-memory (see `should_reduce_batch_size`) pass
    through unchanged. The batch size that worked is kept for later calls of the decorated function.

    Args:
        function: The function to wrap; None when used as `@find_executable_batch_size(starting_batch_size=...)`.
        starting_batch_size: The first batch size tried.
        reduce_batch_size_fn: Called without arguments after an out-of-memory error; returns the next batch size
            (by default, 90% of the current one, rounded down).

    Raises:
        RuntimeError: "No executable batch size found, reached zero." when the batch size reaches zero.
        TypeError: `function` takes no positional parameter, or a caller passed the batch size itself.

    Example:
        ```python
        @find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, model, optimizer):
            loader = DataLoader(dataset, batch_size=batch_size)
            ...

        train(model, optimizer)  # tries 128, then 64, 32, ... until an epoch fits
        ```
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size_parameter = _batch_size_parameter(function)
    batch_size = starting_batch_size

    def shrink_by_a_tenth() -> int:
        # HF Accelerate's documented default since its PR #3684 (it halved before): 128 -> 115 -> 103 -> ...
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or shrink_by_a_tenth

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        _check_call(function, batch_size_parameter, args, kwargs)
        while True:
            clear_device_cache(garbage_collection=True)
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
            # Out of the except block, so that the traceback's frames (and the tensors they hold) can be freed
            # by the collection at the top of the loop.
            batch_size = reduce()

    return decorator
