"""Experiment tracking: HF Accelerate's `accelerate.tracking` names, plus accel's jsonl tracker and run plots.

base.py             GeneralTracker (the contract custom trackers implement), on_main_process, value helpers
registry.py         LoggerType, LOGGER_TYPE_TO_CLASS, register_tracker_class, get_available_trackers, filter_trackers
session.py          TrackerSession: what Accelerator.init_trackers / log / get_tracker / end_training delegate to
*_tracker.py        one backend each (tensorboard, wandb + trackio + swanlab, mlflow, comet_ml, aim, clearml,
                    dvclive, jsonl); each imports its package only when its run starts
runs.py, plot.py    read logged runs (jsonl, TensorBoard event files) and draw them (`accel plot`)

Nothing here imports torch or a tracking package at import time.
"""

import importlib

from accel.tracking.aim_tracker import AimTracker
from accel.tracking.base import GeneralTracker, InactiveTracker, on_main_process
from accel.tracking.clearml_tracker import ClearMLTracker
from accel.tracking.comet_tracker import CometMLTracker
from accel.tracking.dvclive_tracker import DVCLiveTracker
from accel.tracking.jsonl_tracker import JSONLTracker
from accel.tracking.mlflow_tracker import MLflowTracker
from accel.tracking.plot import plot_runs
from accel.tracking.registry import (
    LOGGER_TYPE_TO_CLASS,
    LoggerType,
    MissingTrackerPackageError,
    filter_trackers,
    get_available_trackers,
    is_tracker_available,
    register_tracker_class,
)
from accel.tracking.runs import Run, read_runs
from accel.tracking.tensorboard_tracker import TensorBoardTracker
from accel.tracking.wandb_tracker import SwanLabTracker, TrackioTracker, WandBTracker

# HF's module also exposes the availability checks it imports; they live in accel.availability.
_AVAILABILITY = frozenset(
    f"is_{kind}_available"
    for kind in ("aim", "clearml", "comet_ml", "dvclive", "mlflow", "swanlab", "tensorboard", "trackio", "wandb")
)

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "InactiveTracker",
    "JSONLTracker",
    "LOGGER_TYPE_TO_CLASS",
    "LoggerType",
    "MLflowTracker",
    "MissingTrackerPackageError",
    "Run",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "is_tracker_available",
    "on_main_process",
    "plot_runs",
    "read_runs",
    "register_tracker_class",
    *sorted(_AVAILABILITY),
]


def __getattr__(name):
    if name in _AVAILABILITY:
        return getattr(importlib.import_module("accel.availability"), name)
    raise AttributeError(f"module 'accel.tracking' has no attribute {name!r}")
