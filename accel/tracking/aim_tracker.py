"""Aim: a `Run` in an Aim repository; every value is tracked as Aim takes it."""

from __future__ import annotations

import os
from typing import Any

from accel.tracking.base import GeneralTracker, on_main_process


class AimTracker(GeneralTracker):
    """Logs to Aim (aim < 4).

    Args:
        run_name: the run's name.
        logging_dir: the Aim repository (the Accelerator passes `project_dir` / `logging_dir`).
        **kwargs: passed to `aim.Run`.
    """

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = logging_dir
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Tracks each value under its name; `kwargs` go to `Run.track`."""
        for key, value in values.items():
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, kwargs: dict[str, dict] | None = None) -> None:
        """`values`: name -> image or (image, caption); `kwargs["aim_image"]` go to `aim.Image`, `kwargs["track"]`
        to `Run.track`."""
        import aim

        image_kwargs = (kwargs or {}).get("aim_image", {})
        track_kwargs = (kwargs or {}).get("track", {})
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(image, caption=caption, **image_kwargs), name=key, step=step, **track_kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()
