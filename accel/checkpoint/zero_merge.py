"""Merging a DeepSpeed ZeRO checkpoint into one fp32 weights file: what `accel merge-weights` does with a folder
`save_state` wrote under DeepSpeed (`latest` + `pytorch_model/`), or with the engine's tag folder itself.

The reading is DeepSpeed's own converter (`deepspeed.utils.zero_to_fp32`, the code of the `zero_to_fp32.py` script
DeepSpeed copies into each checkpoint): it gathers every process's fp32 partition of the parameters from the
optimizer files. Those files are pickles that DeepSpeed unpickles in full (as the script does), so merge only
checkpoints you trust; the output is written as `accel merge-weights` writes an FSDP merge (safetensors by default,
under a temporary name, then renamed).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from accel.checkpoint.names import DEEPSPEED_LATEST

logger = logging.getLogger(__name__)

# DeepSpeed's files in each tag folder: model states (`mp_rank_00_...`, under ZeRO-3 one per process) and each
# process's optimizer partition.
_MODEL_STATES = "*model_states.pt"
_OPTIMIZER_STATES = "*optim_states.pt"


def zero_checkpoint_parts(checkpoint_dir: Path) -> tuple[Path, str | None] | None:
    """(the folder holding DeepSpeed's `latest` or tag folders, the tag or None for `latest`'s) when
    `checkpoint_dir` is a ZeRO checkpoint (a save_state folder or a tag folder), else None."""
    if any(checkpoint_dir.glob(_MODEL_STATES)) and any(checkpoint_dir.glob(_OPTIMIZER_STATES)):
        return checkpoint_dir.parent, checkpoint_dir.name
    if (checkpoint_dir / DEEPSPEED_LATEST).is_file():
        return checkpoint_dir, None
    return None


def merge_zero_weights(
    checkpoint_dir: str, output_path: str, safe_serialization: bool = True, remove_checkpoint_dir: bool = False
) -> Path:
    """Writes the fp32 weights of the ZeRO checkpoint in `checkpoint_dir` into `output_path/model.safetensors` (or
    `pytorch_model.bin`); returns the file.

    Raises:
        MergeError: `checkpoint_dir` is not a ZeRO checkpoint, or DeepSpeed is not installed.
    """
    from accel.checkpoint.dcp_merge import MergeError, _write

    parts = zero_checkpoint_parts(Path(checkpoint_dir))
    if parts is None:
        raise MergeError(
            f"'{checkpoint_dir}' is not a DeepSpeed ZeRO checkpoint (no '{DEEPSPEED_LATEST}' file, no "
            f"{_MODEL_STATES} with {_OPTIMIZER_STATES})"
        )
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        from accel.backends.deepspeed import INSTALL

        raise MergeError(f"merging a ZeRO checkpoint needs DeepSpeed: {INSTALL}") from None
    folder, tag = parts
    logger.info(f"Merging DeepSpeed ZeRO weights from {checkpoint_dir}")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    # Tied weights come back as one tensor under two names; a file stores each once (safetensors refuses shared
    # storage), and a model loading it ties them again.
    state_dict = {name: tensor.clone() for name, tensor in state_dict.items()}
    path = _write(state_dict, Path(output_path), safe_serialization)
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)
    logger.info(f"Successfully merged DeepSpeed weights and saved to {os.fspath(path)}")
    return path


__all__ = ["merge_zero_weights", "zero_checkpoint_parts"]
