"""The ragged all-gather over torch.distributed (multi-node, NCCL): usually one collective instead of two.

Gathering tensors whose dim 0 differs between ranks needs each rank's shapes before the data can be placed,
which is two rounds (shapes, then data). Here each rank packs its header (every leaf's dtype and shape) and
its bytes into one slot of `capacity` bytes, and one `all_gather_into_tensor` moves every rank's slot. When
a rank's packed leaves did not fit, every rank sees it in the gathered totals and all run a second round
with slots of the largest total. The capacity then follows the largest total (rounded up to a power of
two), so an evaluation loop whose batches keep their size runs one round per call.

The capacity must be the same on every rank: it is derived only from what all ranks gathered, and it
starts over with each new process group.

Slot layout (int64 words, then bytes): [total bytes, header words, per leaf: dtype index, ndim, sizes...],
then the leaves' bytes back to back.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from accel.errors import DistributedOperationException
from accel.wire.byte_views import byte_view, dense_values

# Stable indices for the header (any order works if every rank runs the same accel).
_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(_DTYPES)}
_PREFIX_WORDS = 2
FIRST_CAPACITY = 4096


def _header(leaves: list[torch.Tensor]) -> list[int]:
    words = []
    for leaf in leaves:
        if leaf.dtype not in _DTYPE_INDEX:
            raise TypeError(f"gather: dtype {leaf.dtype} is not supported")
        words += [_DTYPE_INDEX[leaf.dtype], leaf.dim(), *leaf.shape]
    return words


def pack(leaves: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's slot contents (uint8 on `device`): prefix, header, then every leaf's bytes."""
    header = _header(leaves)
    data = [byte_view(dense_values(leaf)) for leaf in leaves]
    total = 8 * (_PREFIX_WORDS + len(header)) + sum(part.numel() for part in data)
    words = torch.tensor([total, len(header), *header], dtype=torch.int64).view(torch.uint8).to(device)
    return torch.cat([words, *data])


def gather_slots(packed: torch.Tensor, capacity: int, world_size: int, all_gather_into: Callable) -> torch.Tensor:
    """Every rank's first `capacity` bytes of its packed slot, as a (world_size, capacity) uint8 tensor."""
    slot = torch.zeros(capacity, dtype=torch.uint8, device=packed.device)
    used = min(capacity, packed.numel())
    slot[:used] = packed[:used]
    slots = torch.empty(world_size * capacity, dtype=torch.uint8, device=packed.device)
    all_gather_into(slots, slot)
    return slots.view(world_size, capacity)


def totals(slots: torch.Tensor) -> list[int]:
    """Each rank's packed size, read from the prefixes (one small device-to-host copy for GPU slots)."""
    return slots[:, :8].cpu().contiguous().view(torch.int64).view(-1).tolist()


def next_capacity(largest: int) -> int:
    """Room for the largest packed slot seen, rounded up to a power of two (at least FIRST_CAPACITY)."""
    return max(FIRST_CAPACITY, 1 << (largest - 1).bit_length())


def unpack(slots: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf concatenated over the ranks along dim 0, from slots that hold every rank's whole pack."""
    headers = _headers(slots)
    per_rank = [_leaves_of(words) for words in headers]  # [rank][leaf] -> (dtype, shape), parsed once
    _check_leaf_counts([len(leaves) for leaves in per_rank])
    offsets = [8 * (_PREFIX_WORDS + len(words)) for words in headers]
    outputs = []
    for index in range(len(per_rank[0])):
        shapes = [leaves[index] for leaves in per_rank]
        _check_agreement(index, shapes)
        pieces = []
        for rank, (dtype, shape) in enumerate(shapes):
            nbytes = _numel(shape) * dtype.itemsize
            pieces.append(slots[rank, offsets[rank] : offsets[rank] + nbytes])
            offsets[rank] += nbytes
        dtype, shape = shapes[0]
        rows = sum(rank_shape[0] for _, rank_shape in shapes)
        outputs.append(torch.cat(pieces).view(dtype).view(rows, *shape[1:]))
    return outputs


def _headers(slots: torch.Tensor) -> list[list[int]]:
    prefix = slots[:, : 8 * _PREFIX_WORDS].cpu().contiguous().view(torch.int64)
    longest = int(prefix[:, 1].max())
    words = slots[:, 8 * _PREFIX_WORDS : 8 * (_PREFIX_WORDS + longest)].cpu().contiguous().view(torch.int64)
    return [words[rank, : int(prefix[rank, 1])].tolist() for rank in range(slots.shape[0])]


def _leaves_of(words: list[int]) -> list[tuple[torch.dtype, list[int]]]:
    """One rank's header words as (dtype, shape) per leaf."""
    leaves, at = [], 0
    while at < len(words):
        ndim = words[at + 1]
        leaves.append((_DTYPES[words[at]], words[at + 2 : at + 2 + ndim]))
        at += 2 + ndim
    return leaves


def _check_leaf_counts(counts: list[int]) -> None:
    if len(set(counts)) > 1:  # every rank sees the same counts, so all raise (none goes on to hang)
        listing = ", ".join(f"process {rank}: {count}" for rank, count in enumerate(counts))
        raise DistributedOperationException(f"gather: the processes send different numbers of tensors ({listing})")


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _check_agreement(index: int, shapes: list[tuple[torch.dtype, list[int]]]) -> None:
    # Every rank checks the same gathered headers, so all raise together.
    dtype, shape = shapes[0]
    if any(d != dtype or len(s) != len(shape) or s[1:] != shape[1:] for d, s in shapes):
        listing = ", ".join(f"process {rank}: {d} {s}" for rank, (d, s) in enumerate(shapes))
        raise DistributedOperationException(
            f"gather: tensor {index} must have the same dtype and sizes apart from dim 0 on every process; "
            f"got {listing}"
        )


def all_gather_ragged(
    leaves: list[torch.Tensor], state: dict[str, Any], world_size: int, all_gather_into: Callable
) -> list[torch.Tensor]:
    """The ragged all-gather; `state["capacity"]` carries the slot size from one call to the next."""
    device = leaves[0].device if leaves else torch.device("cpu")
    packed = pack(leaves, device)
    capacity = state.setdefault("capacity", FIRST_CAPACITY)
    slots = gather_slots(packed, capacity, world_size, all_gather_into)
    largest = max(totals(slots))
    state["capacity"] = next_capacity(largest)
    if largest > capacity:  # some rank did not fit: everyone saw it, everyone runs the second round
        slots = gather_slots(packed, state["capacity"], world_size, all_gather_into)
    return unpack(slots)
