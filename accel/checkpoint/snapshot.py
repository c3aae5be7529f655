"""The in-memory copy an asynchronous save writes from, so that training may change the live state at once.

Every tensor is copied into a CPU buffer (pinned for GPU tensors); everything else is deep-copied. The buffers are
kept for the next asynchronous save, which joins the previous one before it copies: writing into memory already
faulted in runs at copy speed, while fresh memory costs about as much again in page faults. The peak extra memory
is one copy of what is saved (`SnapshotBuffers.nbytes`); buffers the next snapshot does not use are freed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

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
        result = self._copy(state, free, copies)
        self.nbytes = sum(b.numel() * b.element_size() for buffers in self._buffers.values() for b in buffers)
        logger.info("asynchronous save: a %.1f MiB snapshot of the state", self.nbytes / 2**20)
        return result

    def release(self) -> None:
        """Frees every buffer (end of training)."""
        self._buffers, self.nbytes = {}, 0

    def _copy(self, value: Any, free: dict, copies: dict) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, free, copies)
        if isinstance(value, dict):
            result = copy.copy(value)  # keeps the type (OrderedDict...) and attributes (a state dict's _metadata)
            for key, item in value.items():
                result[key] = self._copy(item, free, copies)
            return result
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(item, free, copies) for item in value)
        return copy.deepcopy(value)

    def _copy_tensor(self, tensor: torch.Tensor, free: dict, copies: dict) -> torch.Tensor:
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
        result.copy_(tensor)
        copies[identity] = result
        return result


buffers = SnapshotBuffers()
