"""`prepare_data_loader`: the user's `DataLoader` rebuilt so that this process gets its share of every batch.

The user's loader and samplers are left as they are (a `RandomSampler` without a generator gets one); the result
is a `DataLoaderShard` (each process reads its share) or, with `dispatch_batches`, a `DataLoaderDispatcher`.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel.backends import DDP_INSTEAD
from accel.data.dispatcher import DataLoaderDispatcher
from accel.data.loaders import copied_kwargs, get_sampler
from accel.data.rng import comm_device, multi_process
from accel.data.samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler
from accel.data.shard_loader import DataLoaderShard
from accel.state import PartialState
from accel.unsupported import refuse

__all__ = ["prepare_data_loader"]


def _with_sampler(batch_sampler, sampler):
    """A copy of `batch_sampler` drawing from `sampler` (the user's batch sampler is left as it is)."""
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    replaced = copy.copy(batch_sampler)
    replaced.sampler = sampler
    return replaced


def _shared_seed(data_seed: int | None) -> int:
    """`data_seed`, else process 0's `torch.initial_seed()` on every process (so all shuffle alike)."""
    if data_seed is not None:
        return data_seed
    seed = [torch.initial_seed()]
    if multi_process():
        dist.broadcast_object_list(seed, src=0, device=comm_device())
    return seed[0]


def _seedable(sampler: RandomSampler, data_seed: int | None) -> SeedableRandomSampler:
    return SeedableRandomSampler(
        data_source=sampler.data_source,
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        generator=sampler.generator,
        data_seed=_shared_seed(data_seed),
    )


def _synchronized_generator(sampler) -> torch.Generator | None:
    """The sampler's generator, given one seeded from the global torch RNG when it has none (as HF does)."""
    if not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None:
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    return sampler.generator


def _check_split_batches(dataloader: DataLoader, num_processes: int) -> None:
    batch_size = dataloader.batch_size
    if batch_size is None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None:
        raise ValueError(
            "split_batches=True needs a `batch_size` attribute on the dataloader or its batch_sampler; both are "
            f"None (batch_sampler is a {type(dataloader.batch_sampler).__name__})."
        )
    if num_processes > 1 and batch_size % num_processes != 0:
        raise ValueError(
            f"To use a `DataLoader` in `split_batches` mode, the batch size ({batch_size}) needs to be a round "
            f"multiple of the number of processes ({num_processes})."
        )


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh=None,
) -> DataLoader:
    """Wraps `dataloader` so that this process gets its share of every batch (HF Accelerate's semantics).

    The user's dataloader and its samplers are not modified, except that a `RandomSampler` without a
    generator gets one (seeded from the torch RNG), which `rng_types=["generator"]` then keeps identical
    across processes.

    Args:
        dataloader: The loader to shard.
        device: Where to put the batches (with `put_on_device`; the dispatcher defaults to this process's device).
        num_processes: The number of processes (default: `PartialState().num_processes`).
        process_index: This process's index (default: `PartialState().process_index`).
        split_batches: Split each batch across the processes (the batch size must be a multiple of
            `num_processes`) instead of giving each process whole batches.
        put_on_device: Move the batches to `device`.
        rng_types: Generators to synchronize at each epoch start: "torch", "cuda", "generator".
        dispatch_batches: Process 0 reads and broadcasts (default: True for an `IterableDataset` when
            `put_on_device`, else False). Needs `put_on_device`.
        even_batches: Complete the last batches with samples from the start so all processes get the same number.
        slice_fn_for_dispatch: How the dispatcher cuts each process's rows (default: `slice_tensors`).
        use_seedable_sampler: Replace a `RandomSampler` with a `SeedableRandomSampler` (same order on every
            process and epoch-reproducible; pair with `set_epoch`).
        non_blocking: Copy batches to the device with `non_blocking=True` (useful with `pin_memory`).
        data_seed: The seed of the `SeedableRandomSampler` (default: process 0's `torch.initial_seed()`).
        use_stateful_dataloader: Build the loader on torchdata's `StatefulDataLoader` (needs `torchdata`):
            `state_dict()` / `load_state_dict()` then save and resume the position within an epoch (with
            `dispatch_batches`, process 0's position, which every process reports).
        torch_device_mesh: Device meshes (tensor/context parallelism) are refused (UnsupportedFeatureError).

    Returns:
        A `DataLoaderShard` or a `DataLoaderDispatcher` (their `StatefulDataLoader` variants with
        `use_stateful_dataloader`).

    Example:
        ```python
        loader = DataLoader(range(8), batch_size=2)
        prepared = prepare_data_loader(loader, num_processes=2, process_index=0)
        list(prepared)  # rank 0: [tensor([0, 1]), tensor([4, 5])]   rank 1: [tensor([2, 3]), tensor([6, 7])]
        ```
    """
    if torch_device_mesh is not None:
        raise refuse("tensor/context parallelism", "prepare_data_loader(torch_device_mesh=...)", DDP_INSTEAD)
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("Using `dispatch_batches=True` requires `put_on_device=True`.")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    if split_batches:
        _check_split_batches(dataloader, num_processes)
    rng_types = list(rng_types) if rng_types is not None else None
    dataset = dataloader.dataset
    batch_sampler = (
        None
        if isinstance(dataset, IterableDataset)
        else (dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler)
    )
    sampler = get_sampler(dataloader)
    if batch_sampler is not None and use_seedable_sampler and isinstance(sampler, RandomSampler):
        sampler = _seedable(sampler, data_seed)
        batch_sampler = _with_sampler(batch_sampler, sampler)
    if use_stateful_dataloader and not isinstance(sampler, SeedableRandomSampler):
        _synchronized_generator(sampler)  # a stateful loader saves the state of the generator its order comes from
    kwargs = copied_kwargs(dataloader)
    kwargs["use_stateful_dataloader"] = use_stateful_dataloader
    if dispatch_batches:
        return _dispatcher(
            dataloader, batch_sampler, split_batches, even_batches, device, slice_fn_for_dispatch, non_blocking, kwargs
        )
    dataset, batch_sampler, synchronized_generator = _shard(
        dataset, batch_sampler, sampler, dataloader, num_processes, process_index, split_batches, even_batches
    )
    if rng_types is not None and synchronized_generator is None and "generator" in rng_types:
        rng_types.remove("generator")
    common = dict(
        device=device if put_on_device else None,
        rng_types=rng_types,
        synchronized_generator=synchronized_generator,
        _drop_last=dataloader.drop_last,
        _non_blocking=non_blocking,
        **kwargs,
    )
    if batch_sampler is None:
        batch_size = dataloader.batch_size
        if split_batches and num_processes > 1:
            batch_size //= num_processes
        return DataLoaderShard(dataset, batch_size=batch_size, drop_last=dataloader.drop_last, **common)
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoaderShard(dataset, sampler=batch_sampler, batch_size=dataloader.batch_size, **common)
    return DataLoaderShard(dataset, batch_sampler=batch_sampler, **common)


def _shard(dataset, batch_sampler, sampler, dataloader, num_processes, process_index, split_batches, even_batches):
    """(dataset, batch sampler, generator to keep synchronized) of this process."""
    if num_processes == 1:
        return dataset, batch_sampler, None
    if isinstance(dataset, IterableDataset):
        shard = IterableDatasetShard(
            dataset, dataloader.batch_size, dataloader.drop_last, num_processes, process_index, split_batches
        )
        return shard, None, getattr(dataset, "generator", None)
    generator = None if isinstance(sampler, SeedableRandomSampler) else _synchronized_generator(sampler)
    shard = BatchSamplerShard(batch_sampler, num_processes, process_index, split_batches, even_batches)
    return dataset, shard, generator


def _dispatcher(dataloader, batch_sampler, split_batches, even_batches, device, slice_fn, non_blocking, kwargs):
    common = dict(
        split_batches=split_batches,
        even_batches=even_batches,
        device=device,
        slice_fn=slice_fn,
        _drop_last=dataloader.drop_last,
        _non_blocking=non_blocking,
        **kwargs,
    )
    if batch_sampler is None:
        return DataLoaderDispatcher(
            dataloader.dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **common
        )
    return DataLoaderDispatcher(dataloader.dataset, batch_sampler=batch_sampler, **common)
