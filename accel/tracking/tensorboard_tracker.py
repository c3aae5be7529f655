"""TensorBoard: event files under `<logging_dir>/<project_name>/`, written by torch's SummaryWriter."""

from __future__ import annotations

import os
import time
from typing import Any

import yaml

from accel.tracking.base import GeneralTracker, SkipWarner, as_number, on_main_process, plain_config


class TensorBoardTracker(GeneralTracker):
    """Logs to TensorBoard (`torch.utils.tensorboard`, else `tensorboardX`).

    Args:
        run_name: the run's folder name under `logging_dir`.
        logging_dir: where the run's folder goes (the Accelerator passes `project_dir` / `logging_dir`).
        **kwargs: passed to `SummaryWriter` (e.g. `flush_secs`).

    Numbers (numpy scalars and one-element tensors too) are scalars, text is text, a dict of numbers is one
    `add_scalars` group; anything else is skipped with one warning naming the key. Nested configuration is
    flattened ("optimizer/lr") and enums, paths and lists are stored as text, where HF Accelerate's tracker raises.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.init_kwargs = kwargs
        self.skipped = SkipWarner(self.name)

    @on_main_process
    def start(self) -> None:
        try:
            from torch.utils import tensorboard
        except ImportError:  # torch's writer needs the tensorboard package; tensorboardX has its own
            import tensorboardX as tensorboard
        self.logging_dir = os.path.join(self.logging_dir_param, self.run_name)
        self.writer = tensorboard.SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Stores `values` in TensorBoard's hyperparameter table and, as HF Accelerate does, in
        `<run>/<timestamp>/hparams.yml` (here in the same folder as the table's event file, not a second one)."""
        plain = plain_config(values)
        timestamp = str(time.time())
        self.writer.add_hparams(plain, metric_dict={}, run_name=timestamp)
        self.writer.flush()
        folder = os.path.join(self.logging_dir, timestamp)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w") as f:
            yaml.safe_dump(plain, f)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Logs numbers as scalars, text as text and dicts of numbers as scalar groups, then flushes.

        `kwargs` go to `add_scalar` / `add_text` / `add_scalars`.
        """
        for key, value in values.items():
            number = as_number(value)
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self._log_group(key, value, step, kwargs)
            else:
                self.skipped.skip(key, value, "numbers, text or a dict of numbers")
        self.writer.flush()

    def _log_group(self, key: str, group: dict, step: int | None, kwargs: dict) -> None:
        numbers = {}
        for name, value in group.items():
            number = as_number(value)
            if number is None:
                self.skipped.skip(f"{key}/{name}", value)
            else:
                numbers[name] = number
        if numbers:
            self.writer.add_scalars(key, numbers, global_step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """`values`: name -> a batch of images (N×C×H×W by default; `dataformats` in kwargs says otherwise)."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()
