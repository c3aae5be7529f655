"""How a model is placed, wrapped and synchronized across processes: one strategy object per setup.

The Accelerator asks `strategy_for(state)` once and delegates; it never branches on DistributedType.
New setups (FSDP) register here.
"""

from __future__ import annotations

from accel.settings import DistributedDataParallelKwargs
from accel.state import DistributedType, PartialState
from accel.strategies.base import Strategy
from accel.strategies.ddp import DDPStrategy
from accel.strategies.single import SingleDeviceStrategy

STRATEGIES = {
    DistributedType.NO: SingleDeviceStrategy,
    DistributedType.MULTI_CPU: DDPStrategy,
    DistributedType.MULTI_GPU: DDPStrategy,
}


def strategy_for(state: PartialState, ddp_kwargs: DistributedDataParallelKwargs | None = None) -> Strategy:
    """The strategy of `state`'s distributed type (`ddp_kwargs` configure DDP where it is used)."""
    try:
        strategy = STRATEGIES[state.distributed_type]
    except KeyError:
        raise NotImplementedError(f"{state.distributed_type} is not supported by accel yet") from None
    return strategy.create(state, ddp_kwargs)


__all__ = ["DDPStrategy", "STRATEGIES", "SingleDeviceStrategy", "Strategy", "strategy_for"]
