"""The trackers of one Accelerator: what `log_with` asked for, built, started, logged to and finished.

The Accelerator's tracking methods are one-line delegations to a `TrackerSession`.

Where trackers run: each tracker runs on the main process, and on every process when its `main_process_only` is
False, as `GeneralTracker`'s contract describes. HF Accelerate's Accelerator runs `init_trackers` and `log` on the
main process only, whatever the tracker says; custom trackers keep HF's behaviour by default (`main_process_only`
is True unless they set it), and the built-in ones all run on the main process only.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from accel.tracking.base import GeneralTracker, InactiveTracker, stacklevel_outside_accel
from accel.tracking.registry import LOGGER_TYPE_TO_CLASS, filter_trackers


def runs_here(tracker: Any, is_main_process: bool) -> bool:
    """Whether a tracker (or tracker class) runs on this process."""
    return is_main_process or not getattr(tracker, "main_process_only", True)


class TrackerSession:
    """What `log_with` asked for, and the trackers `init_trackers` started on this process.

    Args:
        log_with: as `Accelerator(log_with=...)`; checked now (unknown names, missing packages, no directory).
        logging_dir: where trackers that write files put them.
    """

    def __init__(self, log_with: Any, logging_dir: str | os.PathLike | None):
        self.log_with = filter_trackers(log_with, logging_dir)
        if log_with is not None and not self.log_with:
            warnings.warn(
                f"`log_with={log_with}` was passed but no supported trackers are currently installed.",
                stacklevel=stacklevel_outside_accel(),
            )
        self.trackers: list[GeneralTracker] = []  # those running on this process
        self.names: list[str] = []  # every tracker's name, also those running elsewhere
        self.initialized = False
        self.finished: set[int] = set()
        self.warned_uninitialized = False

    def init(
        self,
        project_name: str,
        config: dict | None,
        init_kwargs: dict | None,
        logging_dir: str | os.PathLike | None,
        is_main_process: bool,
    ) -> None:
        """Builds the named trackers, starts those that run here and stores `config` in them.

        If one fails to start, those already started are finished before the error propagates.
        """
        init_kwargs = init_kwargs or {}
        here = []
        for entry in self.log_with:
            if isinstance(entry, GeneralTracker):
                self.names.append(entry.name)
                if runs_here(entry, is_main_process):
                    here.append(entry)
                continue
            tracker_class = LOGGER_TYPE_TO_CLASS[str(entry)]
            self.names.append(tracker_class.name)
            if runs_here(tracker_class, is_main_process):  # built only where it runs: constructors may open things
                here.append(_build(tracker_class, project_name, logging_dir, init_kwargs.get(str(entry), {})))
        self._start(here, config)
        self.trackers.extend(here)
        self.initialized = True

    def _start(self, trackers: list[GeneralTracker], config: dict | None) -> None:
        started: list[GeneralTracker] = []
        try:
            for tracker in trackers:
                tracker.start()
                started.append(tracker)
            if config is not None:
                for tracker in trackers:
                    tracker.store_init_configuration(config)
        except BaseException:
            _finish_quietly(started)
            raise

    def log(self, values: dict, step: int | None, log_kwargs: dict | None, is_main_process: bool) -> None:
        """Logs `values` to every tracker running here; `log_kwargs[name]` go to that tracker's `log`."""
        if not self.initialized:
            self._warn_uninitialized(is_main_process)
            return
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def _warn_uninitialized(self, is_main_process: bool) -> None:
        if self.warned_uninitialized or not is_main_process:
            return
        self.warned_uninitialized = True
        cause = (
            "call Accelerator.init_trackers(project_name) first"
            if self.log_with
            else "no tracker was asked for: pass Accelerator(log_with=...) and call init_trackers"
        )
        warnings.warn(
            f"Accelerator.log: nothing was logged ({cause}); warned once", stacklevel=stacklevel_outside_accel()
        )

    def get(self, name: str, unwrap: bool) -> Any:
        """The tracker named `name` (its backend object with `unwrap`); an inert placeholder where it does not run."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if name in self.names or not self.trackers:
            return InactiveTracker(name)
        raise ValueError(
            f"{name} is not an available tracker stored inside the `Accelerator`; "
            f"it has {[tracker.name for tracker in self.trackers]}"
        )

    def finish(self) -> None:
        """Finishes every tracker running here, once; all of them even if one fails (the first error is raised)."""
        errors = []
        for tracker in self.trackers:
            if id(tracker) in self.finished:
                continue
            self.finished.add(id(tracker))
            try:
                tracker.finish()
            except Exception as error:  # the others still get their files closed
                errors.append(error)
        if errors:
            raise errors[0]


def _build(
    tracker_class: type[GeneralTracker], project_name: str, logging_dir: str | os.PathLike | None, kwargs: dict
) -> GeneralTracker:
    if tracker_class.requires_logging_directory:
        return tracker_class(project_name, logging_dir, **kwargs)
    return tracker_class(project_name, **kwargs)


def _finish_quietly(trackers: list[GeneralTracker]) -> None:
    for tracker in trackers:
        try:
            tracker.finish()
        except Exception as error:  # the start failure that got us here is the error to report
            warnings.warn(f"finishing tracker {tracker.name!r} after a failed start also failed: {error!r}")
