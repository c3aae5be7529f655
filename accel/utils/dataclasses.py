"""`accelerate.utils.dataclasses` import path: re-exports."""

from accel.settings import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DynamoBackend,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from accel.state import DistributedType

__all__ = [
    "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
    "DistributedType", "DynamoBackend", "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProjectConfiguration", "TorchDynamoPlugin",
]  # fmt: skip
