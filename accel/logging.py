"""get_logger: a logger that, in multi-process runs, logs on the main process unless asked otherwise."""

from __future__ import annotations

import logging
import os
from typing import Any

from accel.state import PartialState


class MultiProcessAdapter(logging.LoggerAdapter):
    """`log(..., main_process_only=True, in_order=False)`: main process only, or every process in rank order."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        state = PartialState()
        return not main_process_only or state.is_main_process

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:
            raise RuntimeError(
                "You must initialize the accel state by calling either `PartialState()` or `Accelerator()` "
                "before using the logging utility."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        if not in_order:
            if self._should_log(main_process_only):
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        state = PartialState()
        for rank in range(state.num_processes):  # each rank in turn, separated by barriers
            if rank == state.process_index:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A logger for `name`; the level is `log_level`, else ACCEL_LOG_LEVEL (or ACCELERATE_LOG_LEVEL)."""
    if log_level is None:
        log_level = os.environ.get("ACCEL_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
