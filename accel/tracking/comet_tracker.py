"""Comet: an experiment per run, numbers as metrics, text as "other" fields."""

from __future__ import annotations

from typing import Any

from packaging import version

from accel.tracking.base import GeneralTracker, SkipWarner, as_number, on_main_process, plain_config


class CometMLTracker(GeneralTracker):
    """Logs to Comet (API key and workspace from Comet's own config file or environment).

    Args:
        run_name: the Comet project name.
        **kwargs: passed to `comet_ml.start` (`comet_ml.Experiment` before comet_ml 3.41, which has no `start`).
    """

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.skipped = SkipWarner(self.name)

    @on_main_process
    def start(self) -> None:
        import comet_ml

        has_start = version.parse(comet_ml.__version__) >= version.parse("3.41.0")
        open_experiment = comet_ml.start if has_start else comet_ml.Experiment
        self.writer = open_experiment(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer.log_parameters(plain_config(values))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Numbers -> `log_metric`, text -> `log_other`, dicts of numbers -> `log_metrics`; `kwargs` go along."""
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            number = as_number(value)
            if number is not None:
                self.writer.log_metric(key, number, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)
            else:
                self.skipped.skip(key, value, "numbers, text or a dict of numbers")

    @on_main_process
    def finish(self) -> None:
        self.writer.end()
