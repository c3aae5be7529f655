"""`accelerate.utils.modeling`'s names, as users import them (`from accel.utils.modeling import ...`).

The code lives in accel.big_modeling (sizes, tied weights, device maps, hooks, the offload folder, state dicts),
accel.checkpoint (load_checkpoint_in_model) and accel.precision.amp (the autocast context and gradient scaler HF
also defines in this module).
"""

from accel.big_modeling import (
    align_module_device,
    calculate_maximum_sizes,
    check_device_map,
    check_device_same,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    clean_device_map,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    fallback_allocate,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    get_module_leaves,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    has_offloaded_params,
    id_tensor_storage,
    infer_auto_device_map,
    is_peft_model,
    load_offloaded_weight,
    load_offloaded_weights,
    load_state_dict,
    named_module_tensors,
    offload_weight,
    retie_parameters,
    save_offload_index,
    set_module_tensor_to_device,
)
from accel.checkpoint import SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, load_checkpoint_in_model
from accel.precision.amp import get_grad_scaler, get_mixed_precision_context_manager

__all__ = [
    "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "align_module_device", "calculate_maximum_sizes",
    "check_device_map", "check_device_same", "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device", "clean_device_map", "compute_module_sizes",
    "compute_module_total_buffer_size", "convert_file_size_to_int", "dtype_byte_size", "fallback_allocate",
    "find_tied_parameters", "get_balanced_memory", "get_grad_scaler", "get_max_layer_size", "get_max_memory",
    "get_mixed_precision_context_manager", "get_module_leaves", "get_module_size_with_ties",
    "get_non_persistent_buffers", "get_state_dict_from_offload", "get_state_dict_offloaded_model",
    "has_offloaded_params", "id_tensor_storage", "infer_auto_device_map", "is_peft_model",
    "load_checkpoint_in_model", "load_offloaded_weight", "load_offloaded_weights", "load_state_dict",
    "named_module_tensors", "offload_weight", "retie_parameters", "save_offload_index",
    "set_module_tensor_to_device",
]  # fmt: skip
