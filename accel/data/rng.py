"""Seeding, and keeping random number generators identical across processes.

The synchronization is a broadcast of process 0's generator state, done with torch.distributed directly (one small
collective per generator); with a single process, or without a process group, it does nothing.
"""

from __future__ import annotations

import enum
import random
from typing import Iterable

import torch
import torch.distributed as dist

from accel.state import PartialState

__all__ = ["RNGType", "set_seed", "synchronize_rng_state", "synchronize_rng_states"]


class RNGType(str, enum.Enum):
    """The generators `synchronize_rng_states` can synchronize (HF Accelerate's names; "cpu" means "torch")."""

    TORCH = "torch"
    CUDA = "cuda"
    GENERATOR = "generator"

    @classmethod
    def _missing_(cls, value):
        return cls.TORCH if value == "cpu" else None


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seeds `random`, `numpy` (when installed) and torch on every device.

    Args:
        seed: The seed.
        device_specific: Add this process's index to the seed, so each process draws differently.
        deterministic: Also call `torch.use_deterministic_algorithms(True)` (can be slower).

    Example:
        ```python
        set_seed(42)                        # rank 0 and rank 1 both seed 42
        set_seed(42, device_specific=True)  # rank 0 seeds 42, rank 1 seeds 43
        ```
    """
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too, lazily, without initializing CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)


def multi_process() -> bool:
    """Whether a default process group of more than one process is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def comm_device() -> torch.device:
    """Where tensors for the default group's collectives must be: the current CUDA device under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_from_main(state: torch.Tensor) -> torch.Tensor:
    """Process 0's `state` on every process (a ByteTensor on the CPU)."""
    if not multi_process():
        return state
    if "nccl" in str(dist.get_backend()):
        on_device = state.to(comm_device())
        dist.broadcast(on_device, 0)
        return on_device.cpu()
    state = state.clone()
    dist.broadcast(state, 0)
    return state


def synchronize_rng_state(rng_type: RNGType | str | None = None, generator: torch.Generator | None = None) -> None:
    """Sets one generator on every process to process 0's state.

    Args:
        rng_type: "torch" (or "cpu": the global CPU generator), "cuda" (the current CUDA device's generator) or
            "generator" (`generator`).
        generator: The generator to synchronize when `rng_type` is "generator".

    Example:
        ```python
        synchronize_rng_state("torch")
        torch.rand(1)  # rank 0 and rank 1 draw the same number
        ```
    """
    rng_type = RNGType(rng_type)
    if rng_type == RNGType.CUDA:
        if not torch.cuda.is_available():
            raise ValueError("synchronize_rng_state('cuda') needs CUDA, which is not available in this process.")
        torch.cuda.set_rng_state(_broadcast_from_main(torch.cuda.get_rng_state()))
    elif rng_type == RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs the `generator` to synchronize.")
        generator.set_state(_broadcast_from_main(generator.get_state()))
    else:
        torch.set_rng_state(_broadcast_from_main(torch.get_rng_state()))


def synchronize_rng_states(rng_types: Iterable[RNGType | str], generator: torch.Generator | None = None) -> None:
    """Calls `synchronize_rng_state` for each of `rng_types`, in order (the same order on every process)."""
    for rng_type in rng_types:
        synchronize_rng_state(RNGType(rng_type), generator=generator)
