"""How a model is placed, wrapped and synchronized across processes: one strategy object per setup.

The Accelerator asks `strategy_for(state)` once and delegates; it never branches on DistributedType.
New setups (FSDP) register here.
"""

from __future__ import annotations

from accel.state import DistributedType, PartialState
from accel.strategies.ddp import DDPStrategy
from accel.strategies.single import SingleDeviceStrategy

STRATEGIES = {
    DistributedType.NO: SingleDeviceStrategy,
    DistributedType.MULTI_CPU: DDPStrategy,
    DistributedType.MULTI_GPU: DDPStrategy,
}


def strategy_for(state: PartialState, ddp_kwargs=None) -> SingleDeviceStrategy:
    try:
        strategy = STRATEGIES[state.distributed_type]
    except KeyError:
        raise NotImplementedError(f"{state.distributed_type} is not supported by accel yet") from None
    return strategy(state, ddp_kwargs)


__all__ = ["DDPStrategy", "SingleDeviceStrategy", "STRATEGIES", "strategy_for"]
