"""Training state of DeepSpeed engines in HF Accelerate's layout: the engine's own checkpoint.

`save_state` under DeepSpeed writes, from every process, each engine's checkpoint with its `save_checkpoint` under
the tag `pytorch_model` (`pytorch_model_1`, ... for later engines) — the model states, each process's ZeRO
partition of the optimizer state, the scheduler the engine drives — and DeepSpeed's `latest` file naming that tag,
inside the same staging folder the rest of the checkpoint (RNG states, samplers, registered objects) goes to, so a
process killed mid-save leaves the previous checkpoint whole. `load_state` reads it back with `load_checkpoint`;
DeepSpeed's `zero_to_fp32.py` (copied into the folder) and `accel merge-weights` turn it into full fp32 weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from accel.checkpoint.names import MODEL_NAME, numbered


def engine_tag(index: int) -> str:
    """HF's tag (and folder) of the `index`-th engine's checkpoint."""
    return numbered(MODEL_NAME, index, "")


class DeepSpeedStates:
    """Engines' state as DeepSpeed checkpoints (see the module docstring). Every process calls each method."""

    @staticmethod
    def present(folder: str, models: int) -> bool:
        return models > 0 and all(os.path.isdir(os.path.join(folder, engine_tag(i))) for i in range(models))

    @staticmethod
    def missing(folder: str, models: int, optimizers: int) -> list[str]:
        """The engine checkpoints a load of `models` engines needs that `folder` lacks (the optimizers' state is
        inside them)."""
        return [engine_tag(i) for i in range(models) if not os.path.isdir(os.path.join(folder, engine_tag(i)))]

    @staticmethod
    def save(models: list[Any], optimizers: list[torch.optim.Optimizer], folder: str, durable: bool = False) -> None:
        """Each engine's `save_checkpoint` into `folder`; with `durable`, this process's files are fsynced (DeepSpeed
        writes with torch.save, which does not)."""
        from accel.checkpoint.durability import sync_published

        for i, engine in enumerate(models):
            engine.save_checkpoint(folder, engine_tag(i))
            if durable:
                sync_published(os.path.join(folder, engine_tag(i)))

    @staticmethod
    def load(models: list[Any], optimizers: list[torch.optim.Optimizer], folder: str) -> None:
        """Each engine's `load_checkpoint` from `folder` (model, optimizer partitions, its scheduler)."""
        for i, engine in enumerate(models):
            path, _ = engine.load_checkpoint(folder, engine_tag(i))
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint '{engine_tag(i)}' in '{folder}'")


__all__ = ["DeepSpeedStates", "engine_tag"]
