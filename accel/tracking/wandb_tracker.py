"""Weights & Biases, and the two services that copy its API (trackio, SwanLab): `init`, `config.update`, `run.log`.

Each package is imported when the run starts, never before.
"""

from __future__ import annotations

import importlib
from typing import Any

from accel.tracking.base import GeneralTracker, on_main_process


class _WandbStyleTracker(GeneralTracker):
    """A run opened with `<package>.init(project=run_name, **kwargs)`.

    Values go to the backend unchanged (it takes numbers, text, media and its own objects).

    HF Accelerate marks these trackers `main_process_only = False` but its Accelerator only ever calls them on the
    main process. accel's Accelerator drives each tracker where its `main_process_only` says, so these say True:
    one run per training job, as with HF.
    """

    package = ""
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs

    @property
    def module(self) -> Any:
        return importlib.import_module(self.package)

    @on_main_process
    def start(self) -> None:
        self.run = self.module.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.module.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """`kwargs` go to the backend's `log` (e.g. `commit` for wandb)."""
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class _LogsImages(_WandbStyleTracker):
    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """`values`: name -> list of images (numpy arrays or PIL images), each wrapped in the backend's Image."""
        image = self.module.Image
        for key, images in values.items():
            self.log({key: [image(one) for one in images]}, step=step, **kwargs)


class WandBTracker(_LogsImages):
    """Logs to Weights & Biases.

    Args:
        run_name: the wandb *project* name (as HF Accelerate passes it).
        **kwargs: passed to `wandb.init` (entity, name, tags, mode="offline", dir, ...).
    """

    name = "wandb"
    package = "wandb"

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
        """Logs a `wandb.Table` built from `columns` + `data` or from `dataframe`."""
        table = self.module.Table(columns=columns, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)


class TrackioTracker(_WandbStyleTracker):
    """Logs to trackio (Hugging Face's local-first, wandb-compatible tracker).

    Args:
        run_name: the trackio project name.
        **kwargs: passed to `trackio.init`.
    """

    name = "trackio"
    package = "trackio"


class SwanLabTracker(_LogsImages):
    """Logs to SwanLab.

    Args:
        run_name: the SwanLab project name.
        **kwargs: passed to `swanlab.init` (e.g. mode="local").
    """

    name = "swanlab"
    package = "swanlab"
