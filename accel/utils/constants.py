"""`accelerate.utils.constants` import path: HF Accelerate's constants, re-exported from where accel uses them."""

from accel.accelerator_config import PROFILE_PATTERN_NAME
from accel.availability import (
    MITA_PROFILING_AVAILABLE_PYTORCH_VERSION,
    STR_OPERATION_TO_FUNC,
    XPU_PROFILING_AVAILABLE_PYTORCH_VERSION,
)
from accel.backends.fsdp import FSDP_AUTO_WRAP_POLICY, FSDP_SHARDING_STRATEGY  # transformers' TrainingArguments
from accel.checkpoint import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)
from accel.collectives.operations import TORCH_DISTRIBUTED_OPERATION_TYPES
from accel.environment import TORCH_LAUNCH_PARAMS
from accel.launchers import ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION

__all__ = [name for name in dir() if not name.startswith("_")]
