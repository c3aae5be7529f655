"""`accelerate.utils.operations` import path: re-exports of accel.collectives (every public name of HF's module)."""

from torch.distributed import ReduceOp

from accel.availability import (
    is_npu_available,
    is_torch_distributed_available,
    is_torch_version,
    is_torch_xla_available,
)
from accel.collectives.operations import (
    TENSOR_INT_TO_DTYPE,
    TENSOR_TYPE_TO_INT,
    TORCH_DISTRIBUTED_OPERATION_TYPES,
    GatheredParameters,
    broadcast,
    broadcast_object_list,
    chained_operation,
    copy_tensor_to_devices,
    gather,
    gather_object,
    gather_tensor_shape,
    reduce,
    verify_operation,
)
from accel.collectives.pad_across import CannotPadNestedTensorWarning, pad_across_processes
from accel.errors import DistributedOperationException
from accel.pytree import (
    ConvertOutputsToFp32,
    TensorInformation,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    find_device,
    get_data_structure,
    get_shape,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_namedtuple,
    is_tensor_information,
    is_torch_tensor,
    is_torch_xpu_tensor,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from accel.state import AcceleratorState, DistributedType, PartialState
from accel.wire.padding import pad_input_tensors

__all__ = [name for name in dir() if not name.startswith("_")]
