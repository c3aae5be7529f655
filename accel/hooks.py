"""`accelerate.hooks`' names, as users import them (`from accel.hooks import add_hook_to_module, ...`).

The hooks live in accel.big_modeling (hooks.py, attach.py, model_offload.py, casting.py).
"""

from accel.big_modeling.attach import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from accel.big_modeling.casting import LayerwiseCastingHook, attach_layerwise_casting_hooks
from accel.big_modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
    set_module_tensor_to_device,
)
from accel.big_modeling.model_offload import CpuOffload, UserCpuOffloadHook
from accel.big_modeling.offload import PrefixedDataset
from accel.big_modeling.sizes import get_non_persistent_buffers, named_module_tensors
from accel.pytree import find_device, send_to_device

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "LayerwiseCastingHook",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "attach_layerwise_casting_hooks",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "set_module_tensor_to_device",
    "PrefixedDataset",
    "find_device",
    "get_non_persistent_buffers",
    "named_module_tensors",
    "send_to_device",
]
