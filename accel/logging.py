"""get_logger and tqdm: log lines and progress bars that, in multi-process runs, show on the main process unless
asked otherwise."""

from __future__ import annotations

import logging
import os
from typing import Any

from accel.availability import is_tqdm_available
from accel.state import PartialState


class MultiProcessAdapter(logging.LoggerAdapter):
    """`log(..., main_process_only=True, in_order=False)`: main process only, or every process in rank order.

    Every message is prefixed with `[RANK n]`, the process index of the process that logs it, as HF Accelerate's
    adapter does (so log lines from different processes can be told apart, and parsers of HF's output still match).
    """

    def __init__(self, logger: logging.Logger, extra: Any = None) -> None:
        super().__init__(logger, extra)
        self._warned: set = set()

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        state = PartialState()
        return not main_process_only or state.is_main_process

    def process(self, msg: Any, kwargs: Any) -> tuple[str, Any]:
        """Prefixes `msg` with this process's `[RANK n]` (after the adapter's own processing of `extra`)."""
        msg, kwargs = super().process(msg, kwargs)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:
            raise RuntimeError(
                "You must initialize the accel state by calling either `PartialState()` or `Accelerator()` "
                "before using the logging utility."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)  # the caller's line, not this method's
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if self._should_log(main_process_only):
                self.logger.log(level, msg, *args, **kwargs)
            return
        state = PartialState()
        for rank in range(state.num_processes):  # each rank in turn, separated by barriers
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning(*args, **kwargs)`, emitted only the first time this adapter gets these same arguments.

        Raises:
            TypeError: an argument is unhashable (as in HF Accelerate, whose cache is keyed on the arguments).
        """
        key = (args, tuple(sorted(kwargs.items())))
        if key in self._warned:
            return
        self._warned.add(key)
        kwargs.setdefault("stacklevel", 3)  # the caller of warning_once, not this method
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for `name`; the level is `log_level`, else ACCEL_LOG_LEVEL (or ACCELERATE_LOG_LEVEL)."""
    if log_level is None:
        log_level = os.environ.get("ACCEL_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any):
    """`tqdm.auto.tqdm(*args, **kwargs)`, shown only on each machine's main process unless `main_process_only`
    is False (HF Accelerate's semantics: the local main process, so every machine shows one bar).

    Args:
        *args: Passed to tqdm (the iterable first).
        main_process_only: Disable the bar on the other processes of the machine.
        **kwargs: Passed to tqdm; `disable=True` disables it everywhere.

    Raises:
        ImportError: tqdm is not installed.
        ValueError: a bool as first argument (a call written for an old signature).

    Example::

        for batch in tqdm(dataloader):   # one bar per machine
            ...
    """
    if not is_tqdm_available():
        raise ImportError("accel's `tqdm` requires `tqdm` to be installed. Please run `pip install tqdm`.")
    if args and isinstance(args[0], bool):
        raise ValueError(
            "Passing `True` or `False` as the first argument to accel's `tqdm` wrapper is unsupported. "
            "Please use the `main_process_only` keyword argument instead."
        )
    from tqdm.auto import tqdm as auto_tqdm

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return auto_tqdm(*args, **kwargs, disable=disable)
