"""DDP's gradient synchronization controls behind `Accelerator.trigger_sync_in_backward` and `join_uneven_inputs`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms import Join, Joinable
from torch.nn.parallel import DistributedDataParallel


def find_ddp(model: Any) -> DistributedDataParallel | None:
    """The DDP module in the chain of wrappers around a prepared model (torch.compile's, outside or inside DDP)."""
    while model is not None and not isinstance(model, DistributedDataParallel):
        model = getattr(model, "_orig_mod", None)
    return model


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """The backward run inside synchronizes the gradients of `model`'s DDP, even after forwards under `no_sync`.

    DDP decides at forward time whether the next backward reduces (a forward under `no_sync` leaves the reducer
    unprepared); this sets the sync flags and prepares the reducer for the coming backward, then restores the
    flags (HF Accelerate's mechanism). Without DDP (one process) it does nothing.
    """
    ddp = find_ddp(model)
    if ddp is None:
        yield
        return
    old_backward, old_forward = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
    ddp.require_backward_grad_sync = True
    ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward([])  # no unused parameters to mark: every bucket waits for its gradients
    try:
        yield
    finally:
        ddp.require_backward_grad_sync, ddp.require_forward_param_sync = old_backward, old_forward


def joinable(obj: Any) -> Joinable:
    """The `Joinable` in a prepared object: the DDP module of a model, the optimizer an `AcceleratedOptimizer`
    wraps (torch's ZeroRedundancyOptimizer), or `obj` itself."""
    if isinstance(obj, Joinable):
        return obj
    found = find_ddp(obj) if isinstance(obj, torch.nn.Module) else getattr(obj, "optimizer", None)
    if not isinstance(found, Joinable):
        raise TypeError(
            f"join_uneven_inputs needs DDP models or joinable optimizers (torch.distributed.algorithms."
            f"Joinable); got {type(obj).__name__}. Prepare the model with Accelerator.prepare first."
        )
    return found


@contextlib.contextmanager
def join(joinables: Iterable[Any], enable: bool) -> Iterator[None]:
    """torch's `Join` over the joinables of `joinables`: processes whose data ran out shadow the collectives of
    those still training (DDP's gradient all-reduce) until every process is done."""
    with Join([joinable(obj) for obj in joinables], enable=enable, throw_on_early_termination=False):
        yield


__all__ = ["find_ddp", "join", "joinable", "trigger_sync_in_backward"]
