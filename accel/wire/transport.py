"""The seam between the collectives and the wire: one `Transport` call per collective, for all leaves at once.

`accel.collectives.operations` flattens a pytree into its tensor leaves, asks
`accel.wire.transport_selection.select_transport(leaves)` for an implementation, makes one call on it and
rebuilds the pytree. Two implementations: `TorchDistributedTransport` here (the reference, any backend) and the
same-host `SharedMemoryTransport` (`accel.wire.shm_transport`), which the selection returns for the calls it
can serve.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.distributed as dist

from accel.wire import process_group, ragged
from accel.wire.byte_views import byte_view, dense_values, holds_values
from accel.wire.padding import pad_to_largest_shapes

REDUCE_OPS = ("sum", "max", "min")

# gloo has no kernels for these dtypes; reductions run in the wider type and cast back, which gives the same
# bits as a native reduction would (integer sums wrap the same way modulo 2**bits).
_REDUCE_IN = {
    torch.int16: torch.int64,
    torch.uint16: torch.int64,
    torch.uint32: torch.int64,
    torch.uint64: torch.int64,
    torch.float8_e4m3fn: torch.float32,
    torch.float8_e5m2: torch.float32,
}
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Transport(abc.ABC):
    """Moves the tensor leaves of one collective call between the ranks of the default process group.

    Every method is collective: all ranks call it with leaves of the same count, shapes and dtypes (debug mode
    checks that first) and get their results together.
    """

    @abc.abstractmethod
    def all_gather(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each leaf (at least 1-d) concatenated over the ranks along dim 0, in rank order; new tensors."""

    @abc.abstractmethod
    def all_gather_ragged(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Like `all_gather`, but dim 0 of a leaf may differ between ranks (every other dim must agree)."""

    @abc.abstractmethod
    def all_gather_shapes(self, leaves: list[torch.Tensor]) -> list[list[tuple[int, ...]]]:
        """Every rank's list of leaf shapes, in rank order."""

    def pad_to_largest(
        self, leaves: list[torch.Tensor], dim: int, pad_index: Any, pad_first: bool
    ) -> list[torch.Tensor]:
        """Each leaf padded along `dim` to the largest size the ranks' corresponding leaves have there (HF's
        `pad_across_processes`); a leaf already that large, or without `dim`, is returned as it is.

        Raises `DistributedOperationException` on every rank when the ranks pass different numbers of leaves or
        leaves with different numbers of dims. This implementation exchanges shapes with `all_gather_shapes`.
        """
        return pad_to_largest_shapes(leaves, self.all_gather_shapes(leaves), dim, pad_index, pad_first)

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every rank has called it."""

    @abc.abstractmethod
    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """`src`'s values written into every rank's leaves in place; returns the leaves themselves."""

    @abc.abstractmethod
    def all_reduce(self, leaves: list[torch.Tensor], op: str) -> list[torch.Tensor]:
        """Each leaf reduced elementwise over the ranks with `op` ("sum", "max" or "min"); new tensors.

        The results are bit-identical on every rank. On bool leaves "sum" and "max" are a logical or, "min" a
        logical and. The inputs are not modified.
        """

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""

    @abc.abstractmethod
    def broadcast_object_list(self, object_list: list[Any], src: int) -> list[Any]:
        """`src`'s items written into every rank's `object_list` in place; returns `object_list`."""


def _wait_all(works: list) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor):
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather_single(output, tensor, async_op=True)


def _all_gather_into(output: torch.Tensor, tensor: torch.Tensor) -> None:
    _all_gather_single(output, tensor).wait()


class TorchDistributedTransport(Transport):
    """The reference transport: `torch.distributed` on the default group (gloo, NCCL, ...).

    Tensors travel as raw bytes, so every dtype works on every backend (gloo has no int16, for instance) and a
    gather is bit-exact. Each call issues one asynchronous collective per leaf and waits for all of them.
    `all_gather` writes straight into the result (`all_gather_single`, which gloo supports in torch 2.13),
    without HF Accelerate's list of per-rank buffers and `torch.cat` copy.
    """

    def __init__(self):
        self._ragged: dict = {}

    def all_gather(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        world_size = dist.get_world_size()
        outputs, works = [], []
        for leaf in leaves:
            source = dense_values(leaf)
            output = torch.empty((world_size * leaf.shape[0], *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
            works.append(_all_gather_single(byte_view(output), byte_view(source)))
            outputs.append(output)
        _wait_all(works)
        return outputs

    def all_gather_ragged(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Header and data in one collective while they fit in the last call's slot size (see ragged.py)."""
        group = dist.distributed_c10d._get_default_group()
        if self._ragged.get("group") is not group:  # the slot size is agreed per process group
            self._ragged = {"group": group}
        return ragged.all_gather_ragged(leaves, self._ragged, dist.get_world_size(), _all_gather_into)

    def all_gather_shapes(self, leaves: list[torch.Tensor]) -> list[list[tuple[int, ...]]]:
        return self.all_gather_object([tuple(leaf.shape) for leaf in leaves])

    def barrier(self) -> None:
        process_group.default_group_barrier()

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        buffers = [dense_values(leaf) for leaf in leaves]
        _wait_all([dist.broadcast(byte_view(buffer), src=src, async_op=True) for buffer in buffers])
        if dist.get_rank() != src:
            for leaf, buffer in zip(leaves, buffers):
                if not holds_values(leaf):  # it was received into a copy
                    leaf.detach().copy_(buffer)
        return leaves

    def all_reduce(self, leaves: list[torch.Tensor], op: str) -> list[torch.Tensor]:
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {REDUCE_OPS}")
        buffers = [reduce_buffer(leaf) for leaf in leaves]
        exact = [b for b in buffers if not (b.is_floating_point() or b.is_complex())]
        inexact = [b for b in buffers if b.is_floating_point() or b.is_complex()]
        # Integer and bool reductions are exact in any order: one all_reduce. Floating-point ones depend on the
        # backend's summation order, which may differ between ranks (and NaN handling in max/min may too), so
        # they are reduced onto rank 0 and broadcast from there: bit-identical everywhere, for one more round.
        works = [dist.all_reduce(b, exact_reduce_op(b, op), async_op=True) for b in exact]
        works += [dist.reduce(b, dst=0, op=_TORCH_OPS[op], async_op=True) for b in inexact]
        _wait_all(works)
        _wait_all([dist.broadcast(b, src=0, async_op=True) for b in inexact])
        return [buffer.to(leaf.dtype) for leaf, buffer in zip(leaves, buffers)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object_list(self, object_list: list[Any], src: int) -> list[Any]:
        dist.broadcast_object_list(object_list, src=src)
        return object_list


def reduce_in_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of `dtype` runs in: itself, or a wider one where kernels are missing."""
    return _REDUCE_IN.get(dtype, dtype)


def reduce_buffer(leaf: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `leaf` in the dtype its reduction runs in (backends refuse strided tensors)."""
    dtype = reduce_in_dtype(leaf.dtype)
    return leaf.detach().to(dtype, memory_format=torch.contiguous_format, copy=True)


def exact_reduce_op(buffer: torch.Tensor, op: str) -> dist.ReduceOp:
    # A bool "sum" saturates: it is a logical or, which MAX computes on every backend.
    return dist.ReduceOp.MAX if buffer.dtype == torch.bool and op == "sum" else _TORCH_OPS[op]
