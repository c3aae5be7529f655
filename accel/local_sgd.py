"""Local SGD: every process trains on its own for a few steps, then the processes average their parameters.

Inside `with LocalSGD(accelerator, model, local_sgd_steps) as local_sgd:` gradients are not synchronized (the
DDP model runs under `no_sync`), so each process's optimizer steps on its own gradients; every `local_sgd_steps`
calls of `local_sgd.step()`, and once more on leaving the block, all parameters are replaced by their mean across
processes. Communication drops from one gradient all-reduce per step to one parameter all-reduce every K steps.

(Zhang, De Sa, Mitliagkas, Ré 2016, "Parallel SGD: When does averaging help?"; Stich 2019, "Local SGD Converges
Fast and Communicates Little".)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accel import collectives
from accel.state import DistributedType

_RUNS_LOCAL_SGD = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_NEURON,
}


class LocalSGD:
    """Runs `local_sgd_steps` optimizer steps per process without gradient synchronization, then averages the
    model's parameters across processes. A context manager; call `step()` after each optimizer step.

    Args:
        accelerator: the Accelerator that prepared `model`.
        model: the prepared model whose parameters are averaged.
        local_sgd_steps: optimizer steps between two averagings.
        enabled: False runs ordinary synchronous training (as does a single process).

    Raises:
        NotImplementedError: under a distributed type other than data parallelism (DeepSpeed, FSDP, Megatron-LM...).

    Example:
        ```python
        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in dataloader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
        ```

    Unlike HF, all parameters are averaged in one collective call (HF: one per parameter), and leaving the block
    through an exception does not average (the other processes may never reach the collective).
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        if accelerator.distributed_type not in _RUNS_LOCAL_SGD:
            raise NotImplementedError("LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM)")
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        if self.enabled and (not isinstance(local_sgd_steps, int) or local_sgd_steps < 1):
            raise ValueError(f"local_sgd_steps must be a positive integer, got {local_sgd_steps!r}")
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.ExitStack | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = contextlib.ExitStack()
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if not self.enabled:
            return
        try:
            if exc_type is None:  # after an error other processes may not reach the collective: do not wait for them
                self._sync_and_avg_model_params()
        finally:
            self._no_sync.close()

    def step(self) -> None:
        """Counts one optimizer step; averages the parameters across processes every `local_sgd_steps` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        """Replaces every parameter by its mean across processes (one collective for all of them)."""
        params = list(self.model.parameters())
        if not params:
            return
        averaged = collectives.reduce([param.detach() for param in params], reduction="mean")
        with torch.no_grad():
            for param, mean in zip(params, averaged):
                param.copy_(mean)
