"""The in-memory copy an asynchronous save writes from, so that training may change the live state at once.

Every tensor is copied into a CPU buffer (pinned for GPU tensors; CPU tensors all in one non-temporal copy,
`copy_cpu_pairs`); everything else is deep-copied. The buffers are
kept for the next asynchronous save, which joins the previous one before it copies: writing into memory already
faulted in runs at copy speed, while fresh memory costs about as much again in page faults. The peak extra memory
is one copy of what is saved (`SnapshotBuffers.nbytes`); buffers the next snapshot does not use are freed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from accel import _ext, ops

logger = logging.getLogger(__name__)


class SnapshotBuffers:
    """CPU buffers reused from one snapshot to the next, by dtype and element count."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self.nbytes = 0

    def take(self, state: Any) -> Any:
        """A copy of `state` (nested dicts, lists and tuples of tensors and other objects) that shares no memory
        with it. Tensors that share memory in `state` (tied weights) share it in the copy too."""
        free, self._buffers = self._buffers, {}
        copies: dict[tuple, torch.Tensor] = {}
        cpu_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, CPU tensor): copied after the walk
        result = self._copy(state, free, copies, cpu_pairs)
        copy_cpu_pairs(cpu_pairs)
        self.nbytes = sum(b.numel() * b.element_size() for buffers in self._buffers.values() for b in buffers)
        logger.info("asynchronous save: a %.1f MiB snapshot of the state", self.nbytes / 2**20)
        return result

    def release(self) -> None:
        """Frees every buffer (end of training)."""
        self._buffers, self.nbytes = {}, 0

    def _copy(self, value: Any, free: dict, copies: dict, cpu_pairs: list) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, free, copies, cpu_pairs)
        if isinstance(value, dict):
            result = copy.copy(value)  # keeps the type (OrderedDict...) and attributes (a state dict's _metadata)
            for key, item in value.items():
                result[key] = self._copy(item, free, copies, cpu_pairs)
            return result
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(item, free, copies, cpu_pairs) for item in value)
        return copy.deepcopy(value)

    def _copy_tensor(self, tensor: torch.Tensor, free: dict, copies: dict, cpu_pairs: list) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "meta" or tensor.layout != torch.strided:
            return tensor.clone() if tensor.device.type != "meta" else tensor
        identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and identity in copies:
            return copies[identity]
        key = (tensor.dtype, tensor.numel(), tensor.is_cuda)
        pool = free.get(key)
        buffer = pool.pop() if pool else torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self._buffers.setdefault(key, []).append(buffer)
        result = buffer.view(tensor.shape)
        if type(tensor) is torch.Tensor and tensor.device.type == "cpu" and not tensor.is_quantized:
            cpu_pairs.append((result, tensor))  # a plain CPU tensor: copied with the others after the walk
        else:
            result.copy_(tensor)
        copies[identity] = result
        return result


def copy_cpu_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each CPU source into its buffer in one call (`stream_copy`)."""
    if pairs:
        stream_copy([target for target, _ in pairs], [source for _, source in pairs])


def stream_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i] = sources[i] for CPU tensors, in one call: accel::stream_copy_, whose non-temporal stores keep a
    copy that only the checkpoint writer reads later out of the cache the training loop is using; its reference
    and fallback, torch's foreach copy. What every asynchronous save's in-memory copy goes through (this snapshot,
    accel.checkpoint.shard_stager's kept copy)."""
    if _ext.native_for("stream_copy_", "cpu"):
        ops.stream_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, sources)


buffers = SnapshotBuffers()
