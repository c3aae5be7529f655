"""`accelerate.utils.launch`'s names: the launch helpers live in accel/cli/launch_env.py and accel/launchers.py."""

from accel.cli.launch_env import (
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_sagemager_args_inputs,
    prepare_simple_launcher_cmd_env,
    prepare_tpu,
)
from accel.launchers import PrepareForLaunch

__all__ = [
    "PrepareForLaunch",
    "prepare_deepspeed_cmd_env",
    "prepare_multi_gpu_env",
    "prepare_sagemager_args_inputs",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
]
