"""`accelerate.utils.dataclasses` import path: re-exports of the dataclasses and enums users pass to accel.

The configuration classes live in accel.accelerator_config; those of the backends accel does not run in accel.backends.
"""

from accel.accelerator_config import (
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
    ProfilerActivity,
    ProjectConfiguration,
    SageMakerDistributedType,
    TorchDynamoPlugin,
)
from accel.backends.bnb import BnbQuantizationConfig
from accel.backends.deepspeed import DeepSpeedPlugin
from accel.backends.fp8 import (
    AmaxComputeAlgorithm,
    AORecipeKwargs,
    Backend,
    FP8Format,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    OptLevel,
    TERecipeKwargs,
)
from accel.backends.fsdp import FullyShardedDataParallelPlugin, get_module_class_from_name
from accel.backends.megatron import (
    MODEL_CONFIGS_TO_MEGATRON_PARSERS,
    MegatronLMPlugin,
    add_model_config_to_megatron_parser,
    parse_bert_config,
    parse_glm4_moe_config,
    parse_gpt2_config,
    parse_llama_config,
    parse_t5_config,
)
from accel.backends.parallelism import (
    DeepSpeedSequenceParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
    TorchTensorParallelPlugin,
)
from accel.state import DistributedType

# Defined by other parts of accel (tracking, data, collectives): resolved through accel.utils when first used.
_ELSEWHERE = ("LoggerType", "RNGType", "TensorInformation")

__all__ = [
    "AORecipeKwargs",
    "AmaxComputeAlgorithm",
    "AutocastKwargs",
    "Backend",
    "FP8Format",
    "MODEL_CONFIGS_TO_MEGATRON_PARSERS",
    "OptLevel",
    "ProfilerActivity",
    "parse_bert_config",
    "parse_glm4_moe_config",
    "parse_gpt2_config",
    "parse_llama_config",
    "parse_t5_config",
    "BaseEnum",
    "BnbQuantizationConfig",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "EnumWithContains",
    "FP8BackendType",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "MSAMPRecipeKwargs",
    "MegatronLMPlugin",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "SageMakerDistributedType",
    "TERecipeKwargs",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "add_model_config_to_megatron_parser",
    "get_module_class_from_name",
    *_ELSEWHERE,
]


def __getattr__(name: str):
    if name in _ELSEWHERE:
        import accel.utils

        return getattr(accel.utils, name)
    raise AttributeError(f"module 'accel.utils.dataclasses' has no attribute {name!r}")
