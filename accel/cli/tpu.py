"""`accel tpu-config`: HF Accelerate's options for setting up TPU pods, parsed so its command lines read; running
it is refused (accel does not run TPUs), naming the option or config key that points at a TPU."""

from __future__ import annotations

import argparse

from accel.cli.refusals import refuse_backend

_DESCRIPTION = "Run commands across TPU VMs before `accel launch` (HF Accelerate's; refused: accel runs no TPUs)."


def tpu_command_launcher(args: argparse.Namespace) -> int:
    """Always refuses; the error names what asked for the TPU pod."""
    asked = [f"--{name}" for name in ("tpu_name", "tpu_zone", "command_file", "command") if getattr(args, name)]
    raise refuse_backend("tpu_pod", f"accel tpu-config {' '.join(asked)}".rstrip())


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "tpu-config", help="set up TPU pods (not supported by accel)", description=_DESCRIPTION, allow_abbrev=False
    )
    config = parser.add_argument_group("Config Arguments")
    config.add_argument("--config_file", "--config-file", default=None, help="config file to read the defaults from")
    config.add_argument("--tpu_name", "--tpu-name", default=None, help="the TPU to use")
    config.add_argument("--tpu_zone", "--tpu-zone", default=None, help="the zone of the TPU")
    pod = parser.add_argument_group("TPU Arguments")
    pod.add_argument("--use_alpha", "--use-alpha", action="store_true", help="use `gcloud alpha`")
    pod.add_argument("--command_file", "--command-file", default=None, help="file of commands to run on the pod")
    pod.add_argument("--command", action="append", nargs="+", help="a command to run on the pod (repeatable)")
    pod.add_argument(
        "--install_accelerate", "--install-accelerate", action="store_true", help="install accelerate on the pod"
    )
    pod.add_argument(
        "--accelerate_version",
        "--accelerate-version",
        default="latest",
        help="the accelerate version to install on the pod",
    )
    pod.add_argument("--debug", action="store_true", help="print the command instead of running it")
    parser.set_defaults(run=tpu_command_launcher)
    return parser
