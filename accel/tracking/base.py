"""The tracker contract shared by every backend: `GeneralTracker`, `on_main_process`, and value helpers.

A custom tracker written for HF Accelerate (a `GeneralTracker` subclass with `name`, `requires_logging_directory`
and a `tracker` property) works here unchanged. Torch-free: `accel plot` imports this package without torch.
"""

from __future__ import annotations

import enum
import functools
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def on_main_process(function: Callable) -> Callable:
    """Decorator for tracker methods: runs `function` on the main process only when `self.main_process_only`.

    The process state is looked up when the method runs, not when the class is defined, so building a tracker does
    not create the process group before the user's `InitProcessGroupKwargs` reach the `Accelerator`.
    """

    @functools.wraps(function)
    def run_where_the_tracker_says(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "main_process_only", False):
            return function(self, *args, **kwargs)
        from accel.state import PartialState  # here, not at the top: `accel plot` reads runs without torch

        return PartialState().on_main_process(function)(self, *args, **kwargs)

    return run_where_the_tracker_says


class GeneralTracker:
    """Base class of every tracker; subclass it for a custom one (then pass an instance to `log_with`).

    A subclass defines:
        name (str): what `get_tracker(name)` and `log_kwargs` / `init_kwargs` keys use, e.g. "tensorboard".
        requires_logging_directory (bool): whether its constructor takes the logging directory as second argument.
        tracker (property): the backend's own object (the wandb run, the SummaryWriter, ...).
    and optionally `main_process_only` (default True: the `Accelerator` drives it on the main process only; False:
    on every process) and the methods below. Methods that touch the backend are usually wrapped in
    `accel.tracking.on_main_process`.

    Args:
        _blank: skip the checks (an inert placeholder, as HF Accelerate's `GeneralTracker(_blank=True)`).
    """

    main_process_only = True

    def __init__(self, _blank: bool = False):
        if _blank:
            return
        missing = [
            f"`{attribute}`" for attribute in ("name", "requires_logging_directory") if not hasattr(self, attribute)
        ]
        if "tracker" not in dir(self):  # usually a property that only works after start(): look, don't call
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError(
                "The implementation for this tracker class is missing the following required attributes. "
                f"Please define them in the class definition: {', '.join(missing)}"
            )

    def start(self) -> None:
        """Opens the run (called by `Accelerator.init_trackers`, after the process group exists)."""

    def store_init_configuration(self, values: dict) -> None:
        """Records `values` as the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Records `values` (name -> number, text, ...) at `step`."""

    def finish(self) -> None:
        """Closes the run (called by `Accelerator.end_training`)."""


class InactiveTracker(GeneralTracker):
    """What `get_tracker(name)` returns on a process where that tracker does not run: every call does nothing.

    HF Accelerate returns a bare `GeneralTracker` there, so `get_tracker("wandb").log_images(...)` raises
    AttributeError on every process but the main one; this placeholder takes any method call, and `tracker`
    (what `unwrap=True` would give) is the placeholder itself, so `get_tracker("tensorboard", unwrap=True)
    .add_scalar(...)` is a no-op there too.
    """

    def __init__(self, name: str):
        super().__init__(_blank=True)
        self.name = name
        self.requires_logging_directory = False

    @property
    def tracker(self) -> InactiveTracker:
        return self

    def __getattr__(self, attribute: str) -> Callable[..., None]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _do_nothing

    def __repr__(self) -> str:
        return f"InactiveTracker({self.name!r})"


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


# --- values: what a backend that only takes numbers can take ---------------------------------------------------


def as_number(value: Any) -> int | float | None:
    """`value` as a Python int/float (numpy scalars and one-element tensors or arrays included), else None."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Real):  # numpy scalars register here
        return value.item() if hasattr(value, "item") else float(value)
    item = getattr(value, "item", None)
    if callable(item) and _holds_one_element(value):
        number = item()
        return number if isinstance(number, (bool, int, float)) else None
    return None


def _holds_one_element(value: Any) -> bool:
    numel = getattr(value, "numel", None)  # torch
    if callable(numel):
        return numel() == 1
    return getattr(value, "size", None) == 1  # numpy


class SkipWarner:
    """Warns once per key that a backend cannot take a value, then skips that key silently.

    Training must never crash on a metric a backend cannot store, and a warning per step would bury the log.
    """

    def __init__(self, backend: str):
        self.backend = backend
        self.warned: set[str] = set()

    def skip(self, key: str, value: Any, takes: str = "numbers") -> None:
        if key in self.warned:
            return
        self.warned.add(key)
        warnings.warn(
            f"{self.backend} cannot log {key!r} (a {type(value).__name__}; it takes {takes}): skipped, "
            "and skipped without this warning from now on",
            stacklevel=stacklevel_outside_accel(),
        )


def stacklevel_outside_accel() -> int:
    """The `stacklevel` that points a warning at the first caller outside accel (the user's `log` call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def flatten_config(config: Mapping, separator: str = "/") -> dict[str, Any]:
    """Nested dictionaries become one level ("optimizer/lr"): hyperparameter tables have flat names."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            for inner_key, inner_value in flatten_config(value, separator).items():
                flat[f"{key}{separator}{inner_key}"] = inner_value
        else:
            flat[str(key)] = value
    return flat


def plain_value(value: Any) -> Any:
    """A value as a hyperparameter table stores it: numbers, bools, text and None as they are, else text.

    Enums become their value and paths their text (argparse namespaces hold both; HF's TensorBoard tracker
    would crash on them, which is why transformers' scripts convert them by hand).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    number = as_number(value)
    if number is not None:
        return number
    if isinstance(value, enum.Enum):
        return plain_value(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def plain_config(config: Mapping) -> dict[str, Any]:
    """`config` flattened, every value plain (see `flatten_config` and `plain_value`)."""
    return {key: plain_value(value) for key, value in flatten_config(config).items()}
