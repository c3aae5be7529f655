"""Big-model inference: create a model without allocating its weights, size it, place it over devices.

init_empty_weights / init_on_device (empty.py); sizes (sizes.py: compute_module_sizes, get_max_layer_size,
dtype_byte_size, ...); tied weights (tied.py); device maps (device_map.py: get_max_memory, get_balanced_memory,
infer_auto_device_map, clean_device_map); hooks (hooks.py: ModelHook, AlignDevicesHook, add_hook_to_module,
set_module_tensor_to_device; attach.py: attach_align_device_hook*, align_module_device); whole-model offload for
pipelines (model_offload.py: cpu_offload_with_hook); layerwise casting (casting.py); the offload folder
(offload.py); dispatch_model, cpu_offload, disk_offload and load_checkpoint_and_dispatch (dispatch.py); state dicts
of big models (state_dict.py: load_state_dict, get_state_dict_offloaded_model); is_peft_model (accel.module_tree).
"""

from accel.big_modeling.attach import (
    align_module_device,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    has_offloaded_params,
)
from accel.big_modeling.casting import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
    LayerwiseCastingHook,
    attach_layerwise_casting_hooks,
)
from accel.big_modeling.device_map import (
    check_device_same,
    clean_device_map,
    convert_file_size_to_int,
    fallback_allocate,
    get_balanced_memory,
    get_max_memory,
    get_module_size_with_ties,
    infer_auto_device_map,
)
from accel.big_modeling.dispatch import (
    check_device_map,
    cpu_offload,
    disk_offload,
    dispatch_model,
    load_checkpoint_and_dispatch,
)
from accel.big_modeling.empty import init_empty_weights, init_on_device
from accel.big_modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
    set_module_tensor_to_device,
)
from accel.big_modeling.model_offload import CpuOffload, UserCpuOffloadHook, cpu_offload_with_hook
from accel.big_modeling.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    load_offloaded_weights,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from accel.big_modeling.sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    dtype_byte_size,
    get_max_layer_size,
    get_module_leaves,
    get_non_persistent_buffers,
    id_tensor_storage,
    named_module_tensors,
)
from accel.big_modeling.state_dict import get_state_dict_from_offload, get_state_dict_offloaded_model, load_state_dict
from accel.big_modeling.tied import (
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    retie_parameters,
)
from accel.checkpoint import load_checkpoint_in_model  # HF's big_modeling exposes it too
from accel.module_tree import is_peft_model

__all__ = [
    "init_empty_weights",
    "init_on_device",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "dtype_byte_size",
    "get_max_layer_size",
    "get_module_leaves",
    "get_non_persistent_buffers",
    "id_tensor_storage",
    "named_module_tensors",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "find_tied_parameters",
    "retie_parameters",
    "check_device_same",
    "clean_device_map",
    "convert_file_size_to_int",
    "fallback_allocate",
    "get_balanced_memory",
    "get_max_memory",
    "get_module_size_with_ties",
    "infer_auto_device_map",
    "AlignDevicesHook",
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "set_module_tensor_to_device",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "has_offloaded_params",
    "CpuOffload",
    "UserCpuOffloadHook",
    "cpu_offload_with_hook",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "LayerwiseCastingHook",
    "attach_layerwise_casting_hooks",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
    "check_device_map",
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "load_state_dict",
    "is_peft_model",
    "load_checkpoint_in_model",
]
