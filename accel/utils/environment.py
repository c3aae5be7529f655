"""`accelerate.utils.environment` import path: re-exports of accel.environment, accel.availability and
accel.cpu_affinity."""

from accel.availability import get_current_device_type
from accel.cpu_affinity import override_numa_affinity, set_numa_affinity
from accel.environment import (
    CPUInformation,
    are_libraries_initialized,
    check_cuda_fp8_capability,
    check_cuda_p2p_ib_support,
    clear_environment,
    convert_dict_to_env_variables,
    get_cpu_distributed_information,
    get_driver_version,
    get_gpu_info,
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    purge_accelerate_environment,
    str_to_bool,
)

__all__ = [name for name in dir() if not name.startswith("_")]
