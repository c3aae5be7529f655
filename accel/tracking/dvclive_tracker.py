"""DVCLive: metrics and parameters as files in the repository, for DVC to version."""

from __future__ import annotations

from typing import Any

from accel.tracking.base import GeneralTracker, SkipWarner, on_main_process


class DVCLiveTracker(GeneralTracker):
    """Logs to DVCLive.

    Args:
        run_name: not used (DVCLive names nothing after the project; pass `dir` in kwargs instead).
        live: an existing `dvclive.Live` to log to.
        **kwargs: passed to `dvclive.Live` (e.g. `dir`).
    """

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any):
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs
        self.skipped = SkipWarner(self.name)

    @on_main_process
    def start(self) -> None:
        from dvclive import Live

        if self.live is None:
            self.live = Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Logs what DVCLive takes as a metric (others skipped with one warning), then moves to the next step."""
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in values.items():
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                self.skipped.skip(key, value)
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        self.live.end()
