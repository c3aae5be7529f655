"""Fixtures of the DeepSpeed tests: HF's one-process launcher environment, and Accelerators ended after the test.

Every test here leaves transformers without a DeepSpeed config: a plugin hands transformers its config (HF's weak
reference), and a model built later in the session would otherwise be built partitioned under ZeRO-3 init.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from ds_helpers import DIST_ENV

from accel.accelerator import Accelerator


@pytest.fixture(autouse=True)
def _no_transformers_deepspeed_config():
    yield
    if "transformers.integrations" in sys.modules:
        sys.modules["transformers.integrations"].unset_hf_deepspeed_config()


@pytest.fixture(autouse=True)
def _torch_linear_restored_after():
    """DeepSpeed's ZeRO-3 init replaces torch.nn.functional.linear for the process ("This will persist unless manually
    reset", it says): torch's own is put back after each test, so that later tests run torch's."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture(autouse=True)
def _deepspeed_variables_restored_after(monkeypatch):
    """What an Accelerator running DeepSpeed sets in the environment, as HF's does or a launcher would, is put back
    after each test: ACCELERATE_USE_DEEPSPEED=true (HF's Accelerator sets it), LOCAL_RANK in a process no launcher
    started (DeepSpeed's engine reads it for its whole life)."""
    for name in ("ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK"):
        was_set = name in os.environ
        monkeypatch.setenv(name, os.environ.get(name, ""))  # the undo restores the value before the test, or none
        if not was_set:
            monkeypatch.delenv(name)


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
