"""accel.utils: the names users import from `accelerate.utils`, re-exported from where they live.

Names resolve on first use, so the CLI can import `accel.utils.config` without importing torch.
"""

import importlib

_PUBLIC = {
    "DistributedType": "accel.state",
    "pad_across_processes": "accel.collectives",
    "write_basic_config": "accel.utils.config",
    "DistributedOperationException": "accel.collectives",
    "TensorInformation": "accel.collectives",
    "broadcast": "accel.collectives",
    "broadcast_object_list": "accel.collectives",
    "concatenate": "accel.collectives",
    "find_batch_size": "accel.collectives",
    "find_device": "accel.collectives",
    "gather": "accel.collectives",
    "gather_object": "accel.collectives",
    "get_data_structure": "accel.collectives",
    "honor_type": "accel.collectives",
    "ignorant_find_batch_size": "accel.collectives",
    "initialize_tensors": "accel.collectives",
    "is_namedtuple": "accel.collectives",
    "is_tensor_information": "accel.collectives",
    "is_torch_tensor": "accel.collectives",
    "listify": "accel.collectives",
    "recursively_apply": "accel.collectives",
    "reduce": "accel.collectives",
    "send_to_device": "accel.collectives",
    "slice_tensors": "accel.collectives",
    "AutocastKwargs": "accel.settings",
    "DDPCommunicationHookType": "accel.settings",
    "DataLoaderConfiguration": "accel.settings",
    "DistributedDataParallelKwargs": "accel.settings",
    "DynamoBackend": "accel.settings",
    "GradScalerKwargs": "accel.settings",
    "GradientAccumulationPlugin": "accel.settings",
    "InitProcessGroupKwargs": "accel.settings",
    "KwargsHandler": "accel.settings",
    "ProjectConfiguration": "accel.settings",
    "TorchDynamoPlugin": "accel.settings",
    "get_logger": "accel.logging",
    "clear_device_cache": "accel.memory",
    "find_executable_batch_size": "accel.memory",
    "release_memory": "accel.memory",
    "should_reduce_batch_size": "accel.memory",
    "notebook_launcher": "accel.launchers",
    "debug_launcher": "accel.launchers",
    "RNGType": "accel.data",
    "set_seed": "accel.data",
    "skip_first_batches": "accel.data",
    "synchronize_rng_state": "accel.data",
    "synchronize_rng_states": "accel.data",
    "load_checkpoint_in_model": "accel.checkpoint",
    "compute_module_sizes": "accel.big_modeling",
    "named_module_tensors": "accel.big_modeling",
    "get_max_memory": "accel.big_modeling",
    "get_balanced_memory": "accel.big_modeling",
    "infer_auto_device_map": "accel.big_modeling",
    "convert_file_size_to_int": "accel.big_modeling",
    "CheckpointError": "accel.checkpoint",
    "SAFE_WEIGHTS_NAME": "accel.checkpoint",
    "SAFE_WEIGHTS_INDEX_NAME": "accel.checkpoint",
    "WEIGHTS_NAME": "accel.checkpoint",
    "WEIGHTS_INDEX_NAME": "accel.checkpoint",
    # --- utils core (availability, environment, other, operations, constants, versions, tqdm): helper 1 ---
    # --- end utils core ---
    # --- backends, precision, settings dataclasses and enums: helper 2 ---
    "ComputeEnvironment": "accel.settings",
    "CustomDtype": "accel.settings",
    "PrecisionType": "accel.settings",
    "ProfileKwargs": "accel.settings",
    "SageMakerDistributedType": "accel.settings",
    "get_grad_scaler": "accel.precision.amp",
    "get_mixed_precision_context_manager": "accel.precision.amp",
    "DeepSpeedEngineWrapper": "accel.backends.deepspeed",
    "DeepSpeedOptimizerWrapper": "accel.backends.deepspeed",
    "DeepSpeedPlugin": "accel.backends.deepspeed",
    "DeepSpeedSchedulerWrapper": "accel.backends.deepspeed",
    "DummyOptim": "accel.backends.deepspeed",
    "DummyScheduler": "accel.backends.deepspeed",
    "HfDeepSpeedConfig": "accel.backends.deepspeed",
    "get_active_deepspeed_plugin": "accel.backends.deepspeed",
    "map_pytorch_optim_to_deepspeed": "accel.backends.deepspeed",
    "FullyShardedDataParallelPlugin": "accel.backends.fsdp",
    "disable_fsdp_ram_efficient_loading": "accel.backends.fsdp",
    "enable_fsdp_ram_efficient_loading": "accel.backends.fsdp",
    "ensure_weights_retied": "accel.backends.fsdp",
    "fsdp2_apply_ac": "accel.backends.fsdp",
    "fsdp2_canonicalize_names": "accel.backends.fsdp",
    "fsdp2_load_full_state_dict": "accel.backends.fsdp",
    "fsdp2_prepare_model": "accel.backends.fsdp",
    "fsdp2_switch_optimizer_parameters": "accel.backends.fsdp",
    "get_fsdp2_grad_scaler": "accel.backends.fsdp",
    "load_fsdp_model": "accel.backends.fsdp",
    "load_fsdp_optimizer": "accel.backends.fsdp",
    "save_fsdp_model": "accel.backends.fsdp",
    "save_fsdp_optimizer": "accel.backends.fsdp",
    "AbstractTrainStep": "accel.backends.megatron",
    "BertTrainStep": "accel.backends.megatron",
    "GPTTrainStep": "accel.backends.megatron",
    "MegatronLMDummyDataLoader": "accel.backends.megatron",
    "MegatronLMDummyScheduler": "accel.backends.megatron",
    "MegatronLMPlugin": "accel.backends.megatron",
    "T5TrainStep": "accel.backends.megatron",
    "add_model_config_to_megatron_parser": "accel.backends.megatron",
    "avg_losses_across_data_parallel_group": "accel.backends.megatron",
    "AORecipeKwargs": "accel.backends.fp8",
    "FP8RecipeKwargs": "accel.backends.fp8",
    "MSAMPRecipeKwargs": "accel.backends.fp8",
    "TERecipeKwargs": "accel.backends.fp8",
    "apply_fp8_autowrap": "accel.backends.fp8",
    "contextual_fp8_autocast": "accel.backends.fp8",
    "convert_model": "accel.backends.fp8",
    "convert_model_to_fp8_ao": "accel.backends.fp8",
    "filter_first_and_last_linear_layers": "accel.backends.fp8",
    "has_ao_layers": "accel.backends.fp8",
    "has_transformer_engine_layers": "accel.backends.fp8",
    "BnbQuantizationConfig": "accel.backends.bnb",
    "has_4bit_bnb_layers": "accel.backends.bnb",
    "load_and_quantize_model": "accel.backends.bnb",
    "DeepSpeedSequenceParallelConfig": "accel.backends.parallelism",
    "ParallelismConfig": "accel.backends.parallelism",
    "TorchContextParallelConfig": "accel.backends.parallelism",
    "TorchTensorParallelConfig": "accel.backends.parallelism",
    "TorchTensorParallelPlugin": "accel.backends.parallelism",
    "install_xla": "accel.backends.xla",
    # --- end backends ---
    # --- launch helpers (PrepareForLaunch, prepare_*_env, merge_fsdp_weights): helper 3 ---
    # --- end launch helpers ---
    # --- modeling, offload, hooks: helper 4 ---
    # --- end modeling ---
    # --- tracking (LoggerType, is_*_available of trackers live in helper 1's section): helper 5 ---
    # --- end tracking ---
}
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'accel.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
    return __all__
