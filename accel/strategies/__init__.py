"""How a model is placed, wrapped and synchronized across processes: one strategy object per setup.

The Accelerator asks `strategy_for(state, precision, settings)` once and delegates; it never branches on
DistributedType. Each setup registers its strategy class here.
"""

from __future__ import annotations

from accel.precision import Precision
from accel.state import DistributedType, PartialState
from accel.strategies.base import Strategy, StrategySettings
from accel.strategies.ddp import DDPStrategy
from accel.strategies.deepspeed import DeepSpeedStrategy
from accel.strategies.fsdp2 import FSDP2Strategy
from accel.strategies.single import SingleDeviceStrategy

STRATEGIES = {
    DistributedType.NO: SingleDeviceStrategy,
    DistributedType.MULTI_CPU: DDPStrategy,
    DistributedType.MULTI_GPU: DDPStrategy,
    DistributedType.FSDP: FSDP2Strategy,
    DistributedType.DEEPSPEED: DeepSpeedStrategy,
}


def strategy_for(state: PartialState, precision: Precision, settings: StrategySettings | None = None) -> Strategy:
    """The strategy of `state`'s distributed type, holding `precision` (whose scaler then unscales the gradients
    the strategy's processes hold); `settings` are what the Accelerator was given that a strategy may use."""
    try:
        strategy_class = STRATEGIES[state.distributed_type]
    except KeyError:
        raise NotImplementedError(f"{state.distributed_type} is not supported by accel yet") from None
    strategy = strategy_class.create(state, precision, settings or StrategySettings())
    strategy.precision.sharding = strategy
    return strategy


__all__ = [
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDP2Strategy",
    "STRATEGIES",
    "SingleDeviceStrategy",
    "Strategy",
    "StrategySettings",
    "strategy_for",
]
