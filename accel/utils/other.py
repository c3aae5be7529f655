"""`accelerate.utils.other` import path: re-exports from where each name lives."""

from accel.availability import (
    is_deepspeed_available,
    is_numpy_available,
    is_torch_distributed_available,
    is_torch_version,
    is_torch_xla_available,
    is_weights_only_available,
)
from accel.big_modeling.sizes import id_tensor_storage
from accel.checkpoint.object_io import TORCH_SAFE_GLOBALS, clean_state_dict_for_safetensors, load, save
from accel.cli.basic_config import write_basic_config
from accel.collectives.operations import wait_for_everyone
from accel.compilation import (
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    has_compiled_regions,
    has_repeated_blocks,
    is_compiled_module,
    is_repeated_blocks,
)
from accel.environment import check_os_kernel, get_free_port, is_port_in_use
from accel.formatting import convert_bytes, get_pretty_name
from accel.logging import get_logger
from accel.module_tree import (
    extract_model_from_parallel,
    get_model_tp_size,
    get_module_children_bottom_up,
    model_has_dtensor,
    recursive_getattr,
)
from accel.pytree import merge_dicts
from accel.state import DistributedType, PartialState

__all__ = [name for name in dir() if not name.startswith("_")]
