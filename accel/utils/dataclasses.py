"""`accelerate.utils.dataclasses` import path: re-exports of the dataclasses and enums users pass to accel.

The configuration classes live in accel.settings; those of the backends accel does not run in accel.backends.
"""

from accel.backends.bnb import BnbQuantizationConfig
from accel.backends.deepspeed import DeepSpeedPlugin
from accel.backends.fp8 import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from accel.backends.fsdp import FullyShardedDataParallelPlugin, get_module_class_from_name
from accel.backends.megatron import MegatronLMPlugin, add_model_config_to_megatron_parser
from accel.backends.parallelism import (
    DeepSpeedSequenceParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
    TorchTensorParallelPlugin,
)
from accel.settings import (
    AutocastKwargs,
    BaseEnum,
    ComputeEnvironment,
    CustomDtype,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DynamoBackend,
    EnumWithContains,
    FP8BackendType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    PrecisionType,
    ProfileKwargs,
    ProjectConfiguration,
    SageMakerDistributedType,
    TorchDynamoPlugin,
)
from accel.state import DistributedType

# Defined by other parts of accel (tracking, data, collectives): resolved through accel.utils when first used.
_ELSEWHERE = ("LoggerType", "RNGType", "TensorInformation")

__all__ = [
    "AORecipeKwargs", "AutocastKwargs", "BaseEnum", "BnbQuantizationConfig", "ComputeEnvironment", "CustomDtype",
    "DDPCommunicationHookType", "DataLoaderConfiguration", "DeepSpeedPlugin", "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend", "EnumWithContains", "FP8BackendType",
    "FP8RecipeKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
    "InitProcessGroupKwargs", "KwargsHandler", "MSAMPRecipeKwargs", "MegatronLMPlugin", "PrecisionType",
    "ProfileKwargs", "ProjectConfiguration", "SageMakerDistributedType", "TERecipeKwargs",
    "TorchContextParallelConfig", "TorchDynamoPlugin", "TorchTensorParallelConfig", "TorchTensorParallelPlugin",
    "add_model_config_to_megatron_parser", "get_module_class_from_name", *_ELSEWHERE,
]  # fmt: skip


def __getattr__(name: str):
    if name in _ELSEWHERE:
        import accel.utils

        return getattr(accel.utils, name)
    raise AttributeError(f"module 'accel.utils.dataclasses' has no attribute {name!r}")
