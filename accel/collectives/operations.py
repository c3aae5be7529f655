"""gather, gather_object, broadcast, broadcast_object_list and reduce over pytrees, with HF Accelerate's semantics.

Each operation flattens its pytree into tensor leaves, makes one call on the transport `select_transport`
picks for them (see `accel.wire.transport`) and rebuilds the pytree. On one process every operation
is a no-op, as in HF Accelerate (`reduce` returns copies). With ACCEL_DEBUG_MODE=1 the tensor operations
first compare every rank's structure, shapes, dtypes and devices, and raise `DistributedOperationException`
on every rank when they differ, instead of hanging or mixing up data.

Where accel differs from HF Accelerate:

- `reduce("min")` takes the minimum (HF sums); every reduction gives bit-identical results on all ranks;
  `reduction="none"` performs no operation, as HF documents (HF sums); an unknown reduction is a
  `ValueError`, and "mean" of integer or bool tensors a `TypeError` raised before any communication.
- `reduce(..., scale=s)` multiplies the result by `s` on every backend (HF applies it on XLA only).
- `gather_object` takes a rank's list or tuple as several items and any other object as one item (HF
  iterates over whatever it gets, so a rank's string becomes characters and an int is an error).
- Debug mode also compares dtypes and devices, and a mismatch raises on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import wraps
from typing import Any, Callable

import torch

from accel.collectives import direct
from accel.errors import DistributedOperationException
from accel.pytree import concatenate, recursively_apply, replace_tensor_leaves, send_to_device, tensor_leaves
from accel.state import AcceleratorState, DistributedType, PartialState, is_initialized
from accel.unsupported import refuse
from accel.wire import uneven
from accel.wire.transport_selection import select_transport

REDUCTIONS = ("mean", "sum", "max", "min", "none")
# HF's list of the distributed types whose collectives go through torch.distributed.
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    "DEEPSPEED",
    "MULTI_GPU",
    "FSDP",
    "MEGATRON_LM",
    "TP",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_CPU",
    "MULTI_HPU",
    "MULTI_NEURON",
]
# HF's codes for the dtypes `gather_tensor_shape` reports.
TENSOR_TYPE_TO_INT = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
TENSOR_INT_TO_DTYPE = {code: dtype for dtype, code in TENSOR_TYPE_TO_INT.items()}


# --- debug-mode verification -------------------------------------------------------------------------------------


def _describe(data: Any) -> tuple[Any, list[tuple[str, str]]]:
    """This rank's structure with shapes (other leaves by type name), and each tensor's (dtype, device type)."""
    tensors: list[tuple[str, str]] = []

    def describe(leaf):
        if isinstance(leaf, torch.Tensor):
            tensors.append((str(leaf.dtype).removeprefix("torch."), leaf.device.type))
            return list(leaf.shape)
        return type(leaf).__name__

    return recursively_apply(describe, data, test_type=lambda _: True), tensors


def _listing(title: str, values: list) -> str:
    return f"{title}:\n  - " + "\n  - ".join(f"Process {rank}: {value}" for rank, value in enumerate(values))


def _mismatch(operation: str, everyone: list, device_type: str) -> str | None:
    """The error message when the ranks' descriptions disagree or name a device other than `device_type`."""
    shapes, tensors = [d[0] for d in everyone], [d[1] for d in everyone]
    wrong_device = any(device != device_type for info in tensors for _, device in info)
    if shapes.count(shapes[0]) == len(shapes) and tensors.count(tensors[0]) == len(tensors) and not wrong_device:
        return None
    reason = "shape" if shapes.count(shapes[0]) != len(shapes) else "dtype or device"
    message = (
        f"Cannot apply desired operation due to {reason} mismatches. All shapes across devices must be valid."
        f"\n\nOperation: `{operation}`\n{_listing('Input shapes', shapes)}"
    )
    if reason != "shape":
        message += f"\n{_listing('Input (dtype, device)', tensors)}\nThe process group runs on {device_type}."
    return message


def _state() -> dict:
    """PartialState's fields (started first if need be), read as a dict: the hottest collectives ask on every call,
    and building the singleton's object costs more than the read."""
    return PartialState._shared_state or PartialState().__dict__


def verify_operation(function: Callable | None = None, *, name: str | None = None) -> Callable:
    """Decorates a collective taking a pytree first: in debug mode, checks it agrees across ranks first.

    Every rank's description (structure, shapes, dtypes, devices) is gathered, so a mismatch raises
    `DistributedOperationException` on every rank, naming each rank's shapes and the operation (`name`, default
    the function's). Off unless `PartialState().debug` (ACCEL_DEBUG_MODE=1) and there is more than one process.
    """
    if function is None:
        return lambda decorated: verify_operation(decorated, name=name)
    operation = f"{function.__module__}.{name or function.__name__}"

    @wraps(function)
    def wrapper(*args, **kwargs):
        state = _state()
        if state["num_processes"] > 1 and state["debug"]:
            data = kwargs["tensor"] if "tensor" in kwargs else args[0]
            everyone = select_transport([]).all_gather_object(_describe(data))
            message = _mismatch(operation, everyone, state["device"].type)
            if message is not None:
                raise DistributedOperationException(message)
        return function(*args, **kwargs)

    return wrapper


def chained_operation(function: Callable) -> Callable:
    """Decorates an operation built on verified collectives: a `DistributedOperationException` raised inside it is
    raised again naming this operation, chained to the original (which names the mismatch)."""

    @wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as error:
            operation = f"{function.__module__}.{function.__name__}"
            raise DistributedOperationException(
                f"Error found while calling `{operation}`. Please see the earlier error for more details."
            ) from error

    return wrapper


# --- tensor collectives ------------------------------------------------------------------------------------------


def _as_rows(tensor: Any) -> Any:
    """`tensor` with each 0-d leaf made 1-d, as gathering concatenates along dim 0."""
    return recursively_apply(lambda leaf: leaf[None] if leaf.dim() == 0 else leaf, tensor)


def _gather_in_uneven_step(tensor: Any) -> Any:
    device = next((leaf.device for leaf in tensor_leaves(tensor, "gather")), torch.device("cpu"))
    parts = uneven.exchange("gather", send_to_device(_as_rows(tensor), "cpu"))
    return send_to_device(concatenate([part for part in parts if part is not None]), device)


def gather(tensor: Any) -> Any:
    """Gathers every tensor of a nested list/tuple/dict from all processes, concatenated along dim 0.

    All processes must pass the same structure with the same shapes and dtypes. A 0-d tensor is gathered as
    a 1-d tensor with one element per process. On one process the input is returned as it is.

    Args:
        tensor: A tensor or a nested list/tuple/namedtuple/mapping of tensors.

    Returns:
        The same structure with, in place of each tensor, the concatenation of every process's tensor in
        process order.

    Raises:
        TypeError: a leaf is not a tensor.

    Example (2 processes)::

        # process 0: tensor([0, 1])      process 1: tensor([2, 3])
        gather(torch.arange(2) + 2 * PartialState().process_index)
        # every process: tensor([0, 1, 2, 3])
    """
    leaves = None if _state()["debug"] else direct.flat_leaves(tensor)  # debug mode verifies first
    gathered = None if leaves is None else direct.all_gather(leaves)
    return _gather(tensor) if gathered is None else direct.rebuilt(tensor, gathered)


@uneven.uneven_aware("gather", _gather_in_uneven_step)
@verify_operation(name="gather")
def _gather(tensor: Any) -> Any:
    """`gather`'s general path (any pytree, any transport)."""
    if _state()["num_processes"] == 1:
        return tensor
    leaves = [leaf[None] if leaf.dim() == 0 else leaf for leaf in tensor_leaves(tensor, "gather")]
    return replace_tensor_leaves(tensor, select_transport(leaves).all_gather(leaves))


@uneven.uneven_aware("broadcast", None)
@verify_operation
def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copies every tensor of a nested list/tuple/dict from process `from_process` to all processes, in place.

    Args:
        tensor: A tensor or a nested list/tuple/namedtuple/mapping of tensors, with the same shapes and dtypes
            on every process.
        from_process: The process whose values are sent.

    Returns:
        `tensor` itself, its tensors overwritten with `from_process`'s values.

    Example (2 processes)::

        t = torch.tensor([PartialState().process_index])   # process 0: tensor([0])  process 1: tensor([1])
        broadcast(t, from_process=1)                         # every process: tensor([1]), `t` included
    """
    state = PartialState()
    if state.num_processes == 1:
        return tensor
    if not 0 <= from_process < state.num_processes:
        raise ValueError(f"broadcast: from_process={from_process} is not in 0..{state.num_processes - 1}")
    leaves = tensor_leaves(tensor, "broadcast")
    select_transport(leaves).broadcast(leaves, from_process)
    return tensor


def _reduced_leaves(leaves: list[torch.Tensor], reduction: str) -> list[torch.Tensor]:
    if PartialState().num_processes == 1 or reduction == "none":
        return [leaf.clone() for leaf in leaves]
    return select_transport(leaves).all_reduce(leaves, "sum" if reduction == "mean" else reduction)


def _check_reduction(leaves: list[torch.Tensor], reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduce: unknown reduction {reduction!r}; expected one of {', '.join(REDUCTIONS)}")
    for leaf in leaves:
        if reduction == "mean" and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"reduce(reduction='mean') needs floating-point tensors, got {leaf.dtype}; "
                "use reduction='sum' and divide by the number of processes"
            )


def _reduce_in_uneven_step(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    if reduction != "none":  # a reduction needs every process; "none" communicates nothing
        uneven.exchange("reduce", supported=False)
    copies = [leaf.clone() for leaf in tensor_leaves(tensor, "reduce")]
    return replace_tensor_leaves(tensor, [copy * scale for copy in copies] if scale != 1.0 else copies)


@uneven.uneven_aware("reduce", _reduce_in_uneven_step)
@verify_operation
def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduces every tensor of a nested list/tuple/dict elementwise across all processes.

    Every process gets bit-identical results. On bool tensors "sum" and "max" are a logical or, "min" a
    logical and.

    Args:
        tensor: A tensor or a nested list/tuple/namedtuple/mapping of tensors, with the same shapes and dtypes
            on every process.
        reduction: "mean" (floating-point tensors only), "sum", "max", "min", or "none" (no operation).
        scale: Multiplies the result (as `result * scale`) when not 1.0.

    Returns:
        The same structure with new tensors; the inputs are not modified. On one process, copies.

    Raises:
        ValueError: an unknown reduction.
        TypeError: a leaf is not a tensor, or "mean" of an integer or bool tensor.

    Example (2 processes)::

        t = torch.tensor([1.0, 4.0]) * (PartialState().process_index + 1)  # process 0: [1., 4.]  process 1: [2., 8.]
        reduce(t)                    # every process: tensor([1.5, 6.])
        reduce(t, reduction="min")   # every process: tensor([1., 4.])
    """
    leaves = tensor_leaves(tensor, "reduce")
    _check_reduction(leaves, reduction)
    results = _reduced_leaves(leaves, reduction)
    if reduction == "mean":
        for result in results:
            result /= PartialState().num_processes
    if scale != 1.0:
        results = [result * scale for result in results]
    return replace_tensor_leaves(tensor, results)


# --- object collectives ------------------------------------------------------------------------------------------


def _flatten_items(parts: list[Any]) -> list[Any]:
    return [item for part in parts for item in (part if isinstance(part, (list, tuple)) else [part])]


def _gather_object_in_uneven_step(object: Any) -> list[Any]:
    parts = uneven.exchange("gather_object", (object,))  # boxed: a process may gather None itself
    return _flatten_items([part[0] for part in parts if part is not None])


@uneven.uneven_aware("gather_object", _gather_object_in_uneven_step)
def gather_object(object: Any) -> list[Any] | Any:
    """Gathers picklable objects from all processes into one list.

    Args:
        object: This process's contribution: a list or tuple gives its items, any other object one item.

    Returns:
        Every process's items, in process order; on one process, `object` as it is.

    Example (2 processes)::

        gather_object([f"rank {PartialState().process_index}"])   # every process: ["rank 0", "rank 1"]
        gather_object({"loss": 0.5})                              # every process: [{"loss": 0.5}, {"loss": 0.5}]
    """
    if PartialState().num_processes == 1:
        return object
    return _flatten_items(select_transport([]).all_gather_object(object))


@uneven.uneven_aware("broadcast_object_list", None)
def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replaces the items of `object_list` with those of process `from_process`, in place.

    Args:
        object_list: A list of picklable objects, of the same length on every process.
        from_process: The process whose items are sent.

    Returns:
        `object_list` itself.

    Example (2 processes)::

        items = [PartialState().process_index, None]   # process 0: [0, None]  process 1: [1, None]
        broadcast_object_list(items)                    # every process: [0, None]
    """
    if PartialState().num_processes == 1:
        return object_list
    return select_transport([]).broadcast_object_list(object_list, from_process)


@uneven.uneven_aware("gather", _gather_in_uneven_step)
def gather_ragged(tensor: Any) -> Any:
    """Like `gather`, for ranks whose tensors may differ in length along dim 0 (uneven last batches).

    Every other dim must agree. One call on the transport for the whole structure.

    Example (2 ranks)::

        gather_ragged(torch.arange(rank + 1))   # both ranks: tensor([0, 0, 1])
    """
    if PartialState().num_processes == 1:
        return tensor
    return replace_tensor_leaves(tensor, _all_gather_ragged(tensor_leaves(tensor, "gather_ragged")))


@uneven.uneven_aware("gather", _gather_in_uneven_step)
def gather_ragged_leaves(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """`gather_ragged` of a pytree's tensor leaves, already flattened by the caller (`gather_for_metrics`), so the
    pytree is walked once on the way down and once on the way up.

    Returns:
        The gathered leaves, in order; on one process, `leaves` itself.
    """
    if PartialState().num_processes == 1:
        return leaves
    return _all_gather_ragged(leaves)


def _all_gather_ragged(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    rows = [leaf[None] if leaf.dim() == 0 else leaf for leaf in leaves]
    return select_transport(rows).all_gather_ragged(rows)


# --- one process's tensor to every process -----------------------------------------------------------------------


def _announced_tensor(tensor: torch.Tensor | None, operation: str) -> tuple[int, tuple[int, ...], torch.dtype]:
    """(source process, shape, dtype) of the tensor exactly one process passes (the others pass None)."""
    state = PartialState()
    mine = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
    everyone = [mine] if state.num_processes == 1 else select_transport([]).all_gather_object(mine)
    sources = [rank for rank, item in enumerate(everyone) if item is not None]
    if len(sources) != 1:  # every process sees the same list, so all raise
        given = "no process passed one" if not sources else f"processes {sources} passed one"
        raise ValueError(f"{operation}: exactly one process must pass a tensor, the others None; {given}")
    shape, dtype = everyone[sources[0]]
    return sources[0], shape, dtype


@uneven.uneven_aware("gather_tensor_shape", None)
def gather_tensor_shape(tensor: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The shape and dtype of a tensor only one process has (the others pass None), on every process.

    Returns:
        (the shape as a 1-d int64 tensor on this process's device, the dtype's code in `TENSOR_TYPE_TO_INT`).
        HF returns the shape as an (ndim, 1) tensor and drops dims of size 0; accel keeps every dim.

    Raises:
        ValueError: no process or several passed a tensor, or its dtype has no code.
    """
    _, shape, dtype = _announced_tensor(tensor, "gather_tensor_shape")
    if dtype not in TENSOR_TYPE_TO_INT:
        raise ValueError(f"gather_tensor_shape: {dtype} has no code; codes exist for {list(TENSOR_TYPE_TO_INT)}")
    return torch.tensor(shape, dtype=torch.int64, device=PartialState().device), TENSOR_TYPE_TO_INT[dtype]


@uneven.uneven_aware("copy_tensor_to_devices", None)
def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Sends a tensor that only one process has to every process, which need not know its shape or dtype.

    HF sums the tensor with zeros on the other processes (an all-reduce of the data, after an all-reduce of a
    4 MiB shape buffer, for 10 dtypes only); accel exchanges (shape, dtype) as one small object, then broadcasts
    from the process that has the tensor: exact for every dtype (-0.0 stays -0.0) and cheaper.

    Args:
        tensor: The tensor on exactly one process; None on the others.

    Returns:
        A new tensor with the values on every process (the source process too), on each process's device.

    Raises:
        ValueError: no process or several passed a tensor.

    Example (2 processes)::

        t = torch.arange(3) if PartialState().process_index == 1 else None
        copy_tensor_to_devices(t)   # every process: tensor([0, 1, 2])
    """
    state = PartialState()
    source, shape, dtype = _announced_tensor(tensor, "copy_tensor_to_devices")
    if state.process_index == source:
        result = tensor.to(state.device, copy=True)
    else:
        result = torch.empty(shape, dtype=dtype, device=state.device)
    if state.num_processes > 1:
        broadcast(result, from_process=source)
    return result


def wait_for_everyone() -> None:
    """Blocks until every process reaches this call (a barrier, bounded by the process-group timeout).

    Every process must call it, or the others wait until the timeout and fail.
    """
    PartialState().wait_for_everyone()


@contextlib.contextmanager
def GatheredParameters(
    params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
) -> Iterator[None]:
    """DeepSpeed ZeRO-3's context that gathers partitioned parameters; outside ZeRO-3 a context that does nothing.

    accel does not run DeepSpeed, so parameters are never partitioned and this is the no-op context HF Accelerate
    gives without ZeRO-3: code written for both runs unchanged. Under a DeepSpeed state it refuses.
    """
    if is_initialized() and AcceleratorState().distributed_type == DistributedType.DEEPSPEED:
        raise refuse(
            "DeepSpeed ZeRO-3 parameter gathering",
            "GatheredParameters(...)",
            "accel runs DDP, where every process holds whole parameters: no gathering is needed.",
        )
    yield
