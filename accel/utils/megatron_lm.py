"""`accelerate.utils.megatron_lm` import path: Megatron-LM's names (accel refuses Megatron-LM; see
accel.backends.megatron).
"""

from accel.backends.megatron import (
    AbstractTrainStep,
    BertTrainStep,
    GPTTrainStep,
    MegatronLMDummyDataLoader,
    MegatronLMDummyScheduler,
    T5TrainStep,
    avg_losses_across_data_parallel_group,
)

__all__ = [
    "AbstractTrainStep",
    "BertTrainStep",
    "GPTTrainStep",
    "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler",
    "T5TrainStep",
    "avg_losses_across_data_parallel_group",
]
