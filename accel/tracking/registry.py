"""Which trackers exist, which are installed, and what `log_with=...` asks for.

Availability is answered when asked (not frozen at import, as HF Accelerate does), from accel.availability.
"""

from __future__ import annotations

import difflib
import importlib
import os
import warnings
from typing import Any

from accel.accelerator_config import BaseEnum
from accel.tracking.aim_tracker import AimTracker
from accel.tracking.base import GeneralTracker, stacklevel_outside_accel
from accel.tracking.clearml_tracker import ClearMLTracker
from accel.tracking.comet_tracker import CometMLTracker
from accel.tracking.dvclive_tracker import DVCLiveTracker
from accel.tracking.jsonl_tracker import JSONLTracker
from accel.tracking.mlflow_tracker import MLflowTracker
from accel.tracking.tensorboard_tracker import TensorBoardTracker
from accel.tracking.wandb_tracker import SwanLabTracker, TrackioTracker, WandBTracker


class LoggerType(BaseEnum):
    """The trackers `log_with` can name: HF Accelerate's, plus accel's dependency-free `JSONL`.

    `ALL` means every tracker whose package is installed (and, for those that write files, a logging directory).
    """

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"


LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "aim": AimTracker,
    "comet_ml": CometMLTracker,
    "mlflow": MLflowTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
    "jsonl": JSONLTracker,
}

# What `pip install` needs for each tracker's package.
PIP_REQUIREMENTS = {
    "aim": '"aim<4"',
    "comet_ml": "comet-ml",
    "mlflow": "mlflow",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}
IN_TRACKING_EXTRA = ("tensorboard",)  # pyproject.toml's `tracking` extra (with matplotlib for `accel plot`)


class MissingTrackerPackageError(ImportError):
    """`log_with` named a tracker whose package is not installed."""

    def __init__(self, kind: str):
        install = f"pip install {PIP_REQUIREMENTS[kind]}"
        if kind in IN_TRACKING_EXTRA:
            install += " (or pip install 'accel[tracking]')"
        super().__init__(f"log_with={kind!r} needs the `{kind}` package, which is not installed: {install}", name=kind)
        self.kind = kind


def is_tracker_available(kind: str | LoggerType) -> bool:
    """Whether the package of tracker `kind` is installed (always True for "jsonl", which needs none)."""
    kind = str(kind)
    if kind == LoggerType.JSONL.value:
        return True
    availability = importlib.import_module("accel.availability")
    return getattr(availability, f"is_{kind}_available")()


def get_available_trackers() -> list[LoggerType]:
    """Every tracker whose package is installed, as `LoggerType`s."""
    return [kind for kind in LoggerType if kind is not LoggerType.ALL and is_tracker_available(kind)]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Lets `log_with` name a custom `GeneralTracker` subclass by its `name`, like a built-in tracker.

    The Accelerator builds it in `init_trackers` as `tracker_class(project_name, **init_kwargs[name])`, with the
    logging directory as second argument when `requires_logging_directory`. Register before creating the Accelerator.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"`tracker_class` must be a subclass of `GeneralTracker`, but got {tracker_class}.")
    if not getattr(tracker_class, "name", None):
        raise ValueError("The tracker class to register must define a non-empty `name` attribute.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(
            "The tracker class to register must define a `requires_logging_directory` class attribute "
            "(True if it needs a logging directory, else False)."
        )
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"A tracker named {tracker_class.name!r} is already registered; {tracker_class} replaces it.")
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def filter_trackers(log_with: Any, logging_dir: str | os.PathLike | None = None) -> list[Any]:
    """What `log_with` asks for: `LoggerType`s, registered tracker names and `GeneralTracker` instances, each once.

    Args:
        log_with: a tracker name, a `LoggerType`, a `GeneralTracker` instance, or a list of them; "all" means every
            installed tracker (plus the instances listed beside it).
        logging_dir: where trackers that write files (tensorboard, aim, jsonl) put them.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or a named tracker that writes files
            without a `logging_dir`.
        MissingTrackerPackageError: a named tracker whose package is not installed. (HF Accelerate drops it with
            a debug message; naming a tracker and silently getting none is worse than an error.)
    """
    if log_with is None:
        return []
    requested = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    instances = [entry for entry in requested if isinstance(entry, GeneralTracker)]
    if any(_is_all(entry) for entry in requested):
        return instances + _installed_with_directory(logging_dir)
    chosen: list[Any] = []
    for entry in requested:
        if isinstance(entry, GeneralTracker):
            chosen.append(entry)
            continue
        kind = _kind_of(entry)
        if kind in chosen:
            continue
        if isinstance(kind, LoggerType) and not is_tracker_available(kind):
            raise MissingTrackerPackageError(kind.value)
        if LOGGER_TYPE_TO_CLASS[str(kind)].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{kind}` requires a `logging_dir` to be passed in "
                "(Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...))."
            )
        chosen.append(kind)
    return chosen


def _is_all(entry: Any) -> bool:
    return entry is LoggerType.ALL or (isinstance(entry, str) and entry == LoggerType.ALL.value)


def _kind_of(entry: Any) -> LoggerType | str:
    """A LoggerType for built-in trackers, the name for registered ones; ValueError naming the valid ones else."""
    if isinstance(entry, LoggerType) or (isinstance(entry, str) and entry in LoggerType):
        return LoggerType(entry)
    if isinstance(entry, str) and entry in LOGGER_TYPE_TO_CLASS:
        return entry
    valid = sorted({*LoggerType.list(), *LOGGER_TYPE_TO_CLASS})
    hint = ""
    if isinstance(entry, type) and issubclass(entry, GeneralTracker):
        hint = f" Pass an instance ({entry.__name__}(...)) or call register_tracker_class({entry.__name__}) first."
    elif isinstance(entry, str):
        close = difflib.get_close_matches(entry, valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unsupported logging capability: {entry!r}. Choose between {valid}, or pass a GeneralTracker instance.{hint}"
    )


def _installed_with_directory(logging_dir: str | os.PathLike | None) -> list[LoggerType]:
    """`log_with="all"`: the installed trackers; those that write files only with a directory to write to."""
    installed = get_available_trackers()
    if logging_dir is not None:
        return installed
    needing = [kind for kind in installed if LOGGER_TYPE_TO_CLASS[kind.value].requires_logging_directory]
    shown = [kind.value for kind in needing if kind is not LoggerType.JSONL]  # jsonl is accel's extra: no noise
    if shown:  # HF Accelerate would crash later in init_trackers (os.path.join(None, ...))
        warnings.warn(
            f"log_with='all' leaves out {', '.join(shown)}: they write files and no logging directory "
            "was given (Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...))",
            stacklevel=stacklevel_outside_accel(),
        )
    return [kind for kind in installed if kind not in needing]
