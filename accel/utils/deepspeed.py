"""`accelerate.utils.deepspeed` import path: DeepSpeed's names (the plugin and config: accel.backends.deepspeed;
the engine's wrappers: accel.strategies.deepspeed_wrappers).
"""

from accel.backends.deepspeed import (
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    HfDeepSpeedConfig,
    get_active_deepspeed_plugin,
    map_pytorch_optim_to_deepspeed,
)
from accel.strategies.deepspeed_wrappers import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
)

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedPlugin",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
]
