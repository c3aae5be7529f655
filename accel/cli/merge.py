"""`accel merge-weights CHECKPOINT_DIR OUTPUT_PATH`: one weights file from a sharded checkpoint.

An FSDP one (a DCP folder) goes through accel.checkpoint.dcp_merge.merge_fsdp_weights (HF Accelerate's
`merge_fsdp_weights`; reading a DCP folder needs no FSDP, so this runs wherever accel does); a DeepSpeed ZeRO one
(a save_state folder with `latest`, or its `pytorch_model/`) through accel.checkpoint.zero_merge, on DeepSpeed's
own converter (HF's command merges FSDP checkpoints only).
"""

from __future__ import annotations

import argparse

from accel.cli.errors import CommandError

DESCRIPTION = (
    "Merge the weights of a sharded FSDP checkpoint (SHARDED_STATE_DICT, a torch.distributed.checkpoint folder) "
    "or of a DeepSpeed ZeRO checkpoint (a save_state folder with `latest`, or its pytorch_model/ folder; read by "
    "DeepSpeed's zero_to_fp32, which unpickles its files: merge only checkpoints you trust) into one file, "
    "OUTPUT_PATH/model.safetensors (or pytorch_model.bin). CPU-bound; needs enough memory for the whole state dict."
)


def merge_command(args: argparse.Namespace) -> int:
    """Runs the merge `args` describe (HF's merge_command; the namespace of `merge_command_parser`)."""
    from pathlib import Path

    from accel.checkpoint.dcp_merge import MergeError, merge_fsdp_weights
    from accel.checkpoint.zero_merge import merge_zero_weights, zero_checkpoint_parts

    merge = merge_zero_weights if zero_checkpoint_parts(Path(args.checkpoint_directory)) else merge_fsdp_weights
    try:
        merge(args.checkpoint_directory, args.output_path, not args.unsafe_serialization, args.remove_checkpoint_dir)
    except MergeError as error:
        raise CommandError(str(error)) from None
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_directory", help="the folder of sharded weights saved by FSDP or DeepSpeed")
    parser.add_argument("output_path", help="the folder to write the merged weights into")
    parser.add_argument(
        "--unsafe_serialization",
        "--unsafe-serialization",
        action="store_true",
        default=False,
        help="write pytorch_model.bin (pickle) instead of model.safetensors (not recommended)",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        "--remove-checkpoint-dir",
        action="store_true",
        default=False,
        help="remove the checkpoint folder after merging",
    )


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "merge-weights",
        help="merge a sharded FSDP or DeepSpeed checkpoint into one file",
        description=DESCRIPTION,
        allow_abbrev=False,
    )
    add_arguments(parser)
    parser.set_defaults(run=merge_command)
    return parser
