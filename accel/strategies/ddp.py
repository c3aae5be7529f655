"""Several processes, each with a full copy of the model: torch's DistributedDataParallel (gloo or NCCL)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from accel.accelerator_config import DistributedDataParallelKwargs
from accel.strategies.base import Strategy, compile_model
from accel.wire import uneven


class DDPStrategy(Strategy):
    """Several processes, each with the whole model wrapped in torch's DistributedDataParallel.

    Args:
        state: The process state.
        precision: The mixed-precision policy.
        ddp_kwargs: The Accelerator's `DistributedDataParallelKwargs` (DDP's arguments and communication hook).
    """

    def __init__(self, state, precision, ddp_kwargs: DistributedDataParallelKwargs | None = None):
        super().__init__(state, precision)
        self.ddp_kwargs = ddp_kwargs or DistributedDataParallelKwargs()

    @classmethod
    def create(cls, state, precision, settings) -> DDPStrategy:
        return cls(state, precision, settings.ddp_kwargs)

    def wrap(self, model: torch.nn.Module, dynamo_plugin: Any) -> torch.nn.Module:
        """DDP around the model, compiled as torch advises for DDP.

        Without fullgraph, torch.compile goes around DDP (HF Accelerate's order): dynamo's DDPOptimizer then splits
        the graph at the gradient buckets so communication overlaps the backward. DDP's Python `_pre_forward`
        cannot be traced into one graph, so with fullgraph the model is compiled first and DDP goes around it.
        """
        if not any(p.requires_grad for p in model.parameters()):
            return compile_model(model, dynamo_plugin)  # DDP refuses a model with nothing to train, as HF skips it
        if dynamo_plugin is not None and dynamo_plugin.enabled and dynamo_plugin.fullgraph:
            return self._ddp(compile_model(model, dynamo_plugin))
        return compile_model(self._ddp(model), dynamo_plugin)

    def _ddp(self, model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=device_ids,
            output_device=device_ids[0] if device_ids else None,
            **self.ddp_kwargs.ddp_kwargs(),
        )
        self.ddp_kwargs.register_comm_hook(wrapped)
        wrapped.register_forward_pre_hook(_refuse_to_train_in_uneven_step)
        _release_group_after_reducer(wrapped)
        return wrapped

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            return inner.no_sync()
        return contextlib.nullcontext()


def _release_group_after_reducer(wrapped: torch.nn.parallel.DistributedDataParallel) -> None:
    """Moves DDP's `process_group` attribute after its `reducer` and `logger`, so that freeing the module drops the
    Python reference to the group last.

    Why: once the group is destroyed (`end_training`), the DDP module's references are the group's last. Freed in
    attribute order, the Python `ProcessGroup` went first and the C++ Reducer dropped the last reference, destroying
    a gloo group with the GIL held (pybind frees a Reducer without releasing it). gloo's destructor joins its worker
    threads, and a worker still freeing the last gradient all-reduce needs the GIL to release the gradients' Python
    objects: the rank hung for good (seen on a loaded machine, and every time with a long GIL switch interval). torch
    frees a Python `ProcessGroup` with the GIL released, so when that reference goes last the join cannot deadlock.
    """
    group = wrapped.__dict__.pop("process_group", None)
    if group is not None:
        wrapped.__dict__["process_group"] = group


def _refuse_to_train_in_uneven_step(module: torch.nn.parallel.DistributedDataParallel, args) -> None:
    # A DDP forward with gradients (or with buffers to broadcast) runs collectives of its own, which a
    # process standing by in the last step of an uneven epoch cannot join: fail on every process instead.
    if not uneven.in_uneven_step():
        return
    if torch.is_grad_enabled():
        uneven.exchange("a DDP model's forward with gradients enabled", supported=False)
    elif module.will_sync_module_buffers():
        uneven.exchange(
            "a DDP model's forward that broadcasts its buffers (DistributedDataParallelKwargs("
            "broadcast_buffers=False), or evaluate accelerator.unwrap_model(model))",
            supported=False,
        )
