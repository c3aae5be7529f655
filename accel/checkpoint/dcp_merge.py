"""Merging a torch.distributed.checkpoint (DCP) folder into one weights file: `merge_fsdp_weights`, behind
`accel merge-weights`.

FSDP's SHARDED_STATE_DICT saves write DCP folders (`pytorch_model_fsdp_0/`, `optimizer_0/`): one `.metadata`
file plus per-rank `.distcp` files. Reading them needs neither FSDP nor a process group: the metadata gives
every tensor's full shape and dtype, so the merged tensors are allocated up front and torch's DCP reader fills
them from the shards (public API only; HF Accelerate goes through DCP's private `_load_state_dict`).

Differences from HF Accelerate: the output file is written to a temporary name and renamed (safetensors
through accel's native writer), so an interrupted merge never leaves half a file; with safetensors, a
checkpoint holding non-tensor entries (an optimizer's `param_groups`) is an error naming them, before anything
is written (HF fails inside the writer); only `safe_serialization=False` reads those entries, which DCP stores
pickled and unpickles.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.names import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from accel.checkpoint.safetensors_io import save_file
from accel.checkpoint.sharded import checked_reader
from accel.state import PartialState

logger = logging.getLogger(__name__)


class MergeError(ValueError):
    """A checkpoint folder that cannot be merged; the message names the folder and what is wrong."""


def _missing_folder_message(checkpoint_dir: Path) -> str:
    message = f"Tried to load from {checkpoint_dir} but couldn't find a valid metadata file."
    candidates = [name for name in ("pytorch_model_fsdp_0", "optimizer_0") if (checkpoint_dir / name).exists()]
    if candidates:
        message += " Pass one of these folders instead: " + ", ".join(str(checkpoint_dir / name) for name in candidates)
    return message


def _read_metadata(checkpoint_dir: Path) -> Any:
    if not (checkpoint_dir / ".metadata").is_file():
        raise MergeError(_missing_folder_message(checkpoint_dir))
    return checked_reader(str(checkpoint_dir)).read_metadata()


def _empty_state_dict(metadata: Any, with_objects: bool, checkpoint_dir: Path) -> dict[str, Any]:
    """Full-size tensors to load into, keyed by DCP's flattened names; objects too when `with_objects`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state: dict[str, Any] = {}
    objects = []
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif with_objects:
            state[name] = None  # replaced by the loaded object
        else:
            objects.append(name)
    if objects:
        raise MergeError(
            f"{checkpoint_dir} holds entries that are not tensors ({', '.join(sorted(objects)[:5])}"
            f"{', ...' if len(objects) > 5 else ''}); safetensors stores tensors only: merge with "
            "safe_serialization=False (--unsafe_serialization), which unpickles them"
        )
    return state


def _place(root: dict, path: tuple, value: Any) -> None:
    """Sets root[path[0]][path[1]]... = value, creating lists where the next key is an index (DCP flattens lists)."""
    node: Any = root
    for key, next_key in zip(path, path[1:]):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
        if (node[key] if isinstance(node, list) else node.get(key)) is None:
            node[key] = [] if isinstance(next_key, int) else {}
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _nest(state: dict[str, Any], metadata: Any) -> dict[str, Any]:
    """Back to the saved structure ({"model": {"fc.weight": ...}}), dropping a single top-level wrapper as HF does."""
    paths = metadata.planner_data or {}
    nested: dict[str, Any] = {}
    for name, value in state.items():
        _place(nested, tuple(paths.get(name, (name,))), value)
    if len(nested) == 1 and isinstance(next(iter(nested.values())), dict):
        return next(iter(nested.values()))
    return nested


def load_dcp_state_dict(checkpoint_dir: str | os.PathLike, with_objects: bool = False) -> dict[str, Any]:
    """The full (unsharded) state dict of a DCP folder, on the CPU, without a process group.

    Args:
        checkpoint_dir: the folder holding `.metadata` and the `.distcp` shards.
        with_objects: also load the non-tensor entries (stored pickled: they are unpickled).

    Raises:
        MergeError: no DCP metadata in the folder, or non-tensor entries without `with_objects`.
    """
    import torch.distributed.checkpoint as dcp

    checkpoint_dir = Path(checkpoint_dir)
    metadata = _read_metadata(checkpoint_dir)
    state = _empty_state_dict(metadata, with_objects, checkpoint_dir)
    with warnings.catch_warnings():  # reading in one process is the point, not a fallback worth a warning
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=checked_reader(str(checkpoint_dir)), no_dist=True)
    return _nest(state, metadata)


def _write(state_dict: dict[str, Any], output_path: Path, safe_serialization: bool) -> Path:
    output_path.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        nested = [name for name, value in state_dict.items() if not isinstance(value, torch.Tensor)]
        if nested:
            raise MergeError(
                f"safetensors stores a flat mapping of tensors; these entries hold more: "
                f"{', '.join(nested[:5])}. Merge with safe_serialization=False (--unsafe_serialization)"
            )
        path = output_path / SAFE_WEIGHTS_NAME
        save_file(state_dict, path, metadata={"format": "pt"})
    else:
        path = output_path / WEIGHTS_NAME
        write_atomically(str(path), lambda handle: torch.save(state_dict, handle))
    return path


def merge_fsdp_weights(
    checkpoint_dir: str, output_path: str, safe_serialization: bool = True, remove_checkpoint_dir: bool = False
) -> None:
    """Merges a sharded (DCP) FSDP checkpoint into `output_path/model.safetensors` (or `pytorch_model.bin`).

    HF Accelerate's function of the same name. Under several processes, the main process merges and the others
    wait for it. CPU-bound; needs enough memory for the whole state dict.

    Args:
        checkpoint_dir: the DCP folder (a model's `pytorch_model_fsdp_0` or an optimizer's `optimizer_0`).
        output_path: the folder to write the merged file into (created if missing).
        safe_serialization: write safetensors (default) rather than a pickled `pytorch_model.bin`.
        remove_checkpoint_dir: delete `checkpoint_dir` after a successful merge.

    Raises:
        MergeError: `checkpoint_dir` is not a DCP folder (the message points to one inside it, if any), or it
            holds non-tensor entries and `safe_serialization` is True.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ".metadata").is_file():
        raise MergeError(_missing_folder_message(checkpoint_dir))
    state = PartialState()
    if state.is_main_process:
        logger.info(f"Merging FSDP weights from {checkpoint_dir}")
        state_dict = load_dcp_state_dict(checkpoint_dir, with_objects=not safe_serialization)
        path = _write(state_dict, Path(output_path), safe_serialization)
        logger.info(f"Successfully merged FSDP weights and saved to {path}")
        if remove_checkpoint_dir:
            logger.info(f"Removing old checkpoint directory {checkpoint_dir}")
            shutil.rmtree(checkpoint_dir)
    state.wait_for_everyone()
