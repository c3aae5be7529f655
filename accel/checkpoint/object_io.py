"""`save` and `load`: torch.save / torch.load for training scripts, HF Accelerate's `accelerate.utils.save/load`.

`save` writes on the main process only (or on each machine's main process), as a pickle or as safetensors;
`load` unpickles only what `weights_only=True` allows (tensors, containers, numbers, and the numpy arrays RNG
states hold). Where accel differs from HF:

- Files given by path are written atomically (temporary name, fsync, rename), so a crash leaves the previous
  file intact; safetensors go through accel's writer (`accel.checkpoint.save_file`).
- `safe_serialization=True` accepts any mapping and file objects too (HF: an OrderedDict, by path); shared
  tensors are dropped only where they are exact aliases (HF drops every tensor sharing a storage with an earlier
  one, losing distinct views of it), and from a copy: the caller's dict keeps them (HF's `save` deletes them).
- `load` allows numpy's globals in a context around the one call (HF adds them to, then clears, torch's global
  allow-list, which races with other threads).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import IO, Any

import numpy as np
import torch

from accel.checkpoint.atomic_files import write_atomically
from accel.checkpoint.model_io import without_shared_tensors
from accel.checkpoint.safetensors_io import save_file
from accel.state import PartialState

logger = logging.getLogger(__name__)

_numpy_core = getattr(np, "_core", None) or np.core
# What numpy arrays (such as the RNG states `save_state` writes) need to be rebuilt with `weights_only=True`.
TORCH_SAFE_GLOBALS = [_numpy_core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype]
if hasattr(np, "dtypes"):  # numpy 1.25+
    TORCH_SAFE_GLOBALS.append(np.dtypes.UInt32DType)


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """`state_dict` made savable as safetensors: tensors that alias an earlier one (tied weights) are removed
    from it (with a warning naming them; loading ties them again through the model), and the rest made
    contiguous. Non-tensor values (e.g. bitsandbytes' quantization strings) are kept.

    Returns:
        A new dict; `state_dict` itself loses the removed names, as in HF.
    """
    tensors = {name: value for name, value in state_dict.items() if isinstance(value, torch.Tensor)}
    removed = [name for name in tensors if name not in without_shared_tensors(tensors)]
    for name in removed:
        del state_dict[name]
    if removed:
        logger.warning(
            "Removed shared tensor %s while saving. This should be OK, but check by verifying that you don't receive "
            "any warning while reloading",
            set(removed),
        )
    return {
        name: value.contiguous() if isinstance(value, torch.Tensor) else value for name, value in state_dict.items()
    }


def _save_safetensors(obj: Any, f: str | os.PathLike | IO[bytes]) -> None:
    if not isinstance(obj, Mapping):
        raise TypeError(f"save(safe_serialization=True) takes a mapping of names to tensors, got {type(obj).__name__}")
    tensors = clean_state_dict_for_safetensors(dict(obj))
    wrong = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if wrong:
        raise TypeError(f"save(safe_serialization=True): safetensors holds tensors only; {wrong} are not tensors")
    metadata = {"format": "pt"}
    if isinstance(f, (str, os.PathLike)):
        save_file(tensors, f, metadata=metadata)
    else:
        from safetensors.torch import save as to_bytes

        f.write(to_bytes({name: tensor.cpu() for name, tensor in tensors.items()}, metadata=metadata))


def save(
    obj: Any, f: str | os.PathLike | IO[bytes], save_on_each_node: bool = False, safe_serialization: bool = False
) -> None:
    """Saves `obj` from the main process only; use it in place of `torch.save` in a script every process runs.

    Args:
        obj: What to save (a state dict for `safe_serialization`).
        f: A path or a binary file object.
        save_on_each_node: Save from the main process of each machine instead of the global main process.
        safe_serialization: Save as safetensors (`obj` must map names to tensors) instead of a pickle.

    Example (2 processes)::

        save(model.state_dict(), "weights.safetensors", safe_serialization=True)   # written by process 0 only
    """
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if safe_serialization:
        _save_safetensors(obj, f)
    elif isinstance(f, (str, os.PathLike)):
        write_atomically(os.fspath(f), lambda file: torch.save(obj, file))
    else:
        torch.save(obj, f)


@contextlib.contextmanager
def _numpy_allowed():
    if hasattr(torch.serialization, "safe_globals"):  # torch 2.5+: scoped to this context
        with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
            yield
        return
    previous = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(TORCH_SAFE_GLOBALS)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(previous)


def load(f: str | os.PathLike | IO[bytes], map_location: Any = None, **kwargs: Any) -> Any:
    """`torch.load` with `weights_only=True` unless the caller passes `weights_only`, numpy arrays allowed.

    Args:
        f: A path or a binary file object.
        map_location: As `torch.load`'s (a device, a string, a dict or a function remapping storages).
        **kwargs: Passed to `torch.load` (`weights_only=False` unpickles anything: trusted files only).

    Returns:
        The loaded object.
    """
    kwargs.setdefault("weights_only", True)
    with _numpy_allowed():
        return torch.load(f, map_location=map_location, **kwargs)
