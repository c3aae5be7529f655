"""ClearML: a Task; scalars reported under a title and a train/eval/test series taken from the key's prefix."""

from __future__ import annotations

import os
from typing import Any

from accel.tracking.base import GeneralTracker, SkipWarner, as_number, on_main_process

SERIES_PREFIXES = ("eval", "test", "train")


def title_and_series(key: str) -> tuple[str, str]:
    """ "eval_loss" -> ("loss", "eval"); keys without a known prefix are in the "train" series."""
    for prefix in SERIES_PREFIXES:
        if key.startswith(prefix + "_"):
            return key[len(prefix) + 1 :], prefix
    return key, "train"


class ClearMLTracker(GeneralTracker):
    """Logs to ClearML; a Task already started by the user (`Task.init`) is used and left open.

    Args:
        run_name: the project and task name, unless `CLEARML_PROJECT` / `CLEARML_TASK` say otherwise.
        **kwargs: passed to `Task.init`.
    """

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any):
        super().__init__()
        self.user_provided_run_name = run_name
        self._initialized_externally = False
        self.init_kwargs = kwargs
        self.skipped = SkipWarner(self.name)

    @on_main_process
    def start(self) -> None:
        from clearml import Task

        current = Task.current_task()
        if current:
            self._initialized_externally = True
            self.task = current
            return
        arguments = dict(self.init_kwargs)
        arguments.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        arguments.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**arguments)

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict) -> Any:
        return self.task.connect_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Numbers at a step are scalars (series from the key's train_/eval_/test_ prefix); without a step they are
        single values. Others are skipped with one warning naming the key."""
        reporter = self.task.get_logger()
        for key, value in values.items():
            number = as_number(value)
            if number is None:
                self.skipped.skip(key, value)
            elif step is None:
                reporter.report_single_value(name=key, value=number, **kwargs)
            else:
                title, series = title_and_series(key)
                reporter.report_scalar(title=title, series=series, value=number, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        reporter = self.task.get_logger()
        for key, image in values.items():
            title, series = title_and_series(key)
            reporter.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Reports `dataframe`, or `data` with `columns` as its first row."""
        table = dataframe
        if dataframe is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table needs `data` when `dataframe` is None")
            table = [columns, *data] if columns else data
        title, series = title_and_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Closes the Task this tracker started (one started by the user stays open)."""
        if self.task and not self._initialized_externally:
            self.task.close()
