"""Big-model inference: create a model without allocating its weights, then size it for placement.

init_empty_weights / init_on_device (empty.py); compute_module_sizes (sizes.py); device maps (device_map.py:
get_max_memory, get_balanced_memory, infer_auto_device_map); hooks (hooks.py: AlignDevicesHook,
add_hook_to_module, remove_hook_from_module, set_module_tensor_to_device); the offload folder (offload.py);
dispatch_model, cpu_offload, disk_offload and load_checkpoint_and_dispatch (dispatch.py).
"""

from accel.big_modeling.device_map import (
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from accel.big_modeling.dispatch import cpu_offload, disk_offload, dispatch_model, load_checkpoint_and_dispatch
from accel.big_modeling.empty import init_empty_weights, init_on_device
from accel.big_modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    set_module_tensor_to_device,
)
from accel.big_modeling.offload import OffloadedWeightsLoader, offload_state_dict
from accel.big_modeling.sizes import compute_module_sizes, named_module_tensors

__all__ = [
    "AlignDevicesHook", "ModelHook", "OffloadedWeightsLoader", "SequentialHook", "add_hook_to_module", "cpu_offload",
    "disk_offload", "dispatch_model", "load_checkpoint_and_dispatch", "offload_state_dict", "remove_hook_from_module",
    "set_module_tensor_to_device",
    "compute_module_sizes", "convert_file_size_to_int", "get_balanced_memory", "get_max_memory", "infer_auto_device_map",
    "init_empty_weights", "init_on_device", "named_module_tensors",
]  # fmt: skip
