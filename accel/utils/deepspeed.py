"""`accelerate.utils.deepspeed` import path: DeepSpeed's names (accel refuses DeepSpeed; see
accel.backends.deepspeed).
"""

from accel.backends.deepspeed import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedPlugin,
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
    HfDeepSpeedConfig,
    get_active_deepspeed_plugin,
    map_pytorch_optim_to_deepspeed,
)

__all__ = [
    "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedPlugin", "DeepSpeedSchedulerWrapper",
    "DummyOptim", "DummyScheduler", "HfDeepSpeedConfig", "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed"
]  # fmt: skip
