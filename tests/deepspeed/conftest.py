"""Fixtures of the DeepSpeed tests: HF's one-process launcher environment, and Accelerators ended after the test.

Every test here leaves transformers without a DeepSpeed config: a plugin hands transformers its config (HF's weak
reference), and a model built later in the session would otherwise be built partitioned under ZeRO-3 init.
"""

import os
import sys

import pytest
import torch.distributed as dist
from ds_helpers import DIST_ENV

from accel.accelerator import Accelerator


@pytest.fixture(autouse=True)
def _no_transformers_deepspeed_config():
    yield
    if "transformers.integrations" in sys.modules:
        sys.modules["transformers.integrations"].unset_hf_deepspeed_config()


@pytest.fixture(autouse=True)
def _launcher_local_rank_unset_after(monkeypatch):
    """An Accelerator running DeepSpeed in a process no launcher started sets LOCAL_RANK, as a launcher would (its
    engine reads it for its whole life): the variable is removed again after the test, when it was not set before."""
    if "LOCAL_RANK" not in os.environ:
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.delenv("LOCAL_RANK")  # the undo restores "unset"


@pytest.fixture
def dist_env(monkeypatch):
    """HF's `dist_env`: the variables `accelerate launch --use_deepspeed` exports to one process."""
    for name, value in DIST_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def new_accelerator():
    """Builds Accelerators (`new_accelerator(**kwargs)`) whose training is ended after the test: engines destroyed,
    the process group of one destroyed."""
    made = []

    def make(**kwargs) -> Accelerator:
        accelerator = Accelerator(**kwargs)
        made.append(accelerator)
        return accelerator

    yield make
    for accelerator in made:
        accelerator.free_memory()
    if made and dist.is_initialized():  # the last one holds the process state (a test may have ended it)
        made[-1].end_training()
