"""Collectives in the last step of an uneven epoch, when some processes have no batch left.

With `even_batches=False` the processes of a prepared dataloader may get different numbers of batches (never
more than one apart): in the epoch's last step only some of them have a batch. A plain evaluation loop

    for batch in loader:
        predictions = accelerator.gather_for_metrics(model(batch))

then hangs in HF Accelerate: the processes with a last batch wait in `gather` for those whose loop has ended.
accel lets that step run. Every process knows in advance who has a batch in the last step (the sharding is
deterministic), so:

- a process without one, when its loop ends (inside the loader, before `StopIteration`), *stands by*: it joins
  the collectives the others make in that step, contributing nothing, until they are all done;
- a process with one runs each collective of that step as one exchange of its payload with every process
  (standing-by ones send `None`), then, when its loop ends, tells the others it is done.

Gathers (`gather`, `gather_for_metrics`, `gather_object`), `pad_across_processes` and `wait_for_everyone`
can run in that step; the gathered result holds the data of the processes that had a batch. A collective
whose meaning needs every process (`reduce`, `broadcast`, `backward` with DDP's gradient all-reduce) raises
`DistributedOperationException` on every process instead of hanging. Collectives that accel does not see
(a raw `torch.distributed` call) cannot be joined: keep them out of that step, or use `even_batches=True`.
"""

from __future__ import annotations

import dataclasses
from functools import wraps
from typing import Any, Callable

import torch.distributed as dist

from accel.errors import DistributedOperationException
from accel.gradient_state import GradientState


@dataclasses.dataclass(frozen=True)
class _Call:
    """A process with a batch runs collective `name`; `payload` is its contribution."""

    name: str
    payload: Any = None
    supported: bool = True


@dataclasses.dataclass(frozen=True)
class _Done:
    """A process with a batch finished the step (its loop ended)."""


@dataclasses.dataclass(frozen=True)
class _StandingBy:
    """A process without a batch, waiting to join the next collective."""


def in_uneven_step() -> bool:
    """Whether this process is in the last step of an uneven epoch, holding one of its batches."""
    loader = GradientState.current_dataloader()
    return loader is not None and getattr(loader, "in_uneven_step", False)


def exchange(name: str, payload: Any = None, supported: bool = True) -> list[Any]:
    """Runs collective `name` in the uneven step: every process's payload, `None` for those without a batch.

    Called by a process with a batch. When `supported` is False every process raises (the ones standing by
    learn the name from the exchange), which is how a collective that needs every process fails cleanly.
    """
    messages = _all_gather(_Call(name, payload, supported))
    try:
        _check_agreement(messages)
        if not supported:
            raise _unsupported(name)
    except DistributedOperationException:
        _leave_uneven_step()  # every process raised: nobody is left to tell that this one is done
        raise
    return [message.payload if isinstance(message, _Call) else None for message in messages]


def _leave_uneven_step() -> None:
    GradientState().active_dataloader.in_uneven_step = False


def finish() -> None:
    """Called by a process with a batch when the uneven step is over: releases those standing by."""
    _check_agreement(_all_gather(_Done()))


def stand_by() -> None:
    """Called by a process without a batch: joins the others' collectives until they are done."""
    while True:
        messages = _all_gather(_StandingBy())
        calls = _check_agreement(messages)
        if not calls:
            return
        if not calls[0].supported:
            raise _unsupported(calls[0].name)


def _all_gather(message: Any) -> list[Any]:
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return messages


def _check_agreement(messages: list[Any]) -> list[_Call]:
    """The calls of this exchange; raises on every process when the processes with a batch disagree."""
    active = [(rank, m) for rank, m in enumerate(messages) if not isinstance(m, _StandingBy)]
    names = {rank: m.name if isinstance(m, _Call) else "loop ended" for rank, m in active}
    if len(set(names.values())) > 1:
        listing = ", ".join(f"process {rank}: {name}" for rank, name in names.items())
        raise DistributedOperationException(
            f"the processes with a batch in the last step ran different collectives ({listing})"
        )
    return [m for _, m in active if isinstance(m, _Call)]


def _unsupported(name: str) -> DistributedOperationException:
    return DistributedOperationException(
        f"{name} cannot run in the last step of this epoch: with even_batches=False some processes have no "
        "batch in it, and this operation needs every process. Move it after the loop, or use "
        "even_batches=True (the default) in DataLoaderConfiguration"
    )


def uneven_aware(name: str, run_in_uneven_step: Callable | None) -> Callable[[Callable], Callable]:
    """Decorates collective `name`: in an uneven step it runs `run_in_uneven_step(*args, **kwargs)` instead.

    `run_in_uneven_step` uses `exchange`; None marks a collective that cannot run there (it raises on every
    process).
    """

    def decorate(function: Callable) -> Callable:
        @wraps(function)
        def wrapper(*args, **kwargs):
            if not in_uneven_step():
                return function(*args, **kwargs)
            if run_in_uneven_step is None:
                exchange(name, supported=False)
            return run_in_uneven_step(*args, **kwargs)

        return wrapper

    return decorate
