"""Nested lists/tuples/namedtuples/mappings of tensors ("pytrees"), walked with HF Accelerate's semantics.

The one module that walks nested data: the collectives, the dataloaders, the hooks and the precision wrappers
all use it. Containers are rebuilt with their own type: `type(data)(...)` for mappings, so dict subclasses such
as transformers' `BatchEncoding` and `ModelOutput` keep their type, and positional arguments for namedtuples
(a mapping type that cannot be built from a dict, such as `defaultdict`, comes back as a plain dict, where HF
Accelerate raises TypeError). Leaves are visited depth first in container order (list order, mapping insertion
order); `tensor_leaves` and `replace_tensor_leaves` rely on that order, which is the one `recursively_apply`
follows.

Where the dataloaders need another behaviour than HF's public helper, the helper has its own name:
`batch_rows` (never raises) beside `find_batch_size`, `concatenate_batches` (carries other leaves through)
beside `concatenate`.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch


def is_torch_tensor(tensor: Any) -> bool:
    """Whether `tensor` is a `torch.Tensor` (or a subclass)."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Whether `data` is a namedtuple (a tuple with `_fields` and `_asdict`)."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable) -> Any:
    """The items of `generator` in a container of `obj`'s type (list, tuple or namedtuple)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def _rebuild_mapping(mapping: Mapping, items: dict) -> Any:
    """`items` in a mapping of `mapping`'s type, or a plain dict when that type cannot be built from one."""
    try:
        return type(mapping)(items)
    except TypeError:  # e.g. defaultdict, whose first argument is its default factory
        return items


@dataclass
class TensorInformation:
    """What is needed to allocate a tensor: its shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether `tensor_info` is a `TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def recursively_apply(
    func: Callable,
    data: Any,
    *args,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs,
) -> Any:
    """Applies `func` to every leaf of a nested list/tuple/namedtuple/mapping for which `test_type` holds.

    Args:
        func: Called as `func(leaf, *args, **kwargs)`.
        data: The nested structure.
        *args: Passed to `func` after the leaf.
        test_type: Selects the leaves `func` applies to (default: tensors).
        error_on_other_type: Raise `TypeError` on a leaf `test_type` rejects, instead of keeping it as is.
        **kwargs: Passed to `func`.

    Returns:
        The same structure (containers rebuilt with their own type) with `func`'s results as leaves.

    Example::

        recursively_apply(torch.Tensor.float, {"ids": torch.tensor([1]), "names": ["a"]})
        # {"ids": tensor([1.]), "names": ["a"]}
    """

    def apply(item):
        return recursively_apply(
            func, item, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
        )

    if isinstance(data, (tuple, list)):
        return honor_type(data, (apply(item) for item in data))
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {key: apply(value) for key, value in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{test_type.__name__}` should be passed."
        )
    return data


def tensor_leaves(data: Any, operation: str) -> list[torch.Tensor]:
    """The tensors of `data` in `recursively_apply`'s order; `TypeError` naming `operation` on any other leaf."""
    if isinstance(data, torch.Tensor):  # the common case, on every collective's path
        return [data]
    leaves: list[torch.Tensor] = []
    _collect_tensors(data, leaves, operation)
    return leaves


def _collect_tensors(item: Any, leaves: list[torch.Tensor], operation: str) -> None:
    if isinstance(item, (tuple, list)):
        children = item
    elif isinstance(item, Mapping):
        children = item.values()
    elif isinstance(item, torch.Tensor):
        leaves.append(item)
        return
    else:
        raise TypeError(
            f"Unsupported types ({type(item)}) passed to `{operation}`. Only nested list/tuple/dicts of "
            "tensors should be passed."
        )
    for child in children:
        if isinstance(child, torch.Tensor):  # no call per leaf: containers of tensors are the common case
            leaves.append(child)
        else:
            _collect_tensors(child, leaves, operation)


def replace_tensor_leaves(data: Any, leaves: Iterable[torch.Tensor]) -> Any:
    """`data` rebuilt with `leaves` in place of its tensors, in `tensor_leaves`'s order (containers rebuilt as
    `recursively_apply` rebuilds them, other leaves kept)."""
    if isinstance(data, torch.Tensor):
        return next(iter(leaves))
    return _rebuild(data, iter(leaves))


def _rebuild(data: Any, remaining: Iterator[torch.Tensor]) -> Any:
    # `recursively_apply(lambda _: next(remaining), data)` without its per-node keyword plumbing: every collective
    # returns through here.
    if isinstance(data, (tuple, list)):
        return honor_type(
            data, [next(remaining) if isinstance(item, torch.Tensor) else _rebuild(item, remaining) for item in data]
        )
    if isinstance(data, Mapping):
        return _rebuild_mapping(
            data,
            {
                key: next(remaining) if isinstance(value, torch.Tensor) else _rebuild(value, remaining)
                for key, value in data.items()
            },
        )
    if isinstance(data, torch.Tensor):
        return next(remaining)
    return data


def _move(tensor: Any, device: Any, non_blocking: bool) -> Any:
    try:
        return tensor.to(device, non_blocking=non_blocking)
    except TypeError:  # a `.to` without `non_blocking`
        return tensor.to(device)


def send_to_device(
    tensor: Any, device: Any, non_blocking: bool = False, skip_keys: str | list[str] | None = None
) -> Any:
    """Moves every tensor of a nested list/tuple/mapping to `device`.

    Any object with a `.to` method (a tensor, a `BatchEncoding`, a module) is moved with it. Unlike HF
    Accelerate, a mapping that has `.to` is walked instead when `skip_keys` names one of its keys, so the
    skipped entries really stay where they are.

    Args:
        tensor: A tensor, an object with `.to`, or a nested list/tuple/mapping of them.
        device: The target device.
        non_blocking: Asynchronous copy where the device supports it.
        skip_keys: Mapping keys whose values are left as they are (a key or a list of keys).

    Returns:
        The same structure with every tensor on `device`; other leaves unchanged.
    """
    skip_keys = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or [])
    walk_mapping = isinstance(tensor, Mapping) and any(key in tensor for key in skip_keys)
    if (isinstance(tensor, torch.Tensor) or hasattr(tensor, "to")) and not walk_mapping:
        return _move(tensor, device, non_blocking)
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, Mapping):
        return _rebuild_mapping(
            tensor,
            {
                key: value if key in skip_keys else send_to_device(value, device, non_blocking, skip_keys)
                for key, value in tensor.items()
            },
        )
    return tensor


def get_shape(data: Any) -> Any:
    """The same structure with each tensor replaced by its shape as a list (what debug mode compares)."""
    return recursively_apply(lambda tensor: list(tensor.shape), data)


def get_data_structure(data: Any) -> Any:
    """The same structure with each tensor replaced by its `TensorInformation` (shape and dtype)."""
    return recursively_apply(lambda tensor: TensorInformation(shape=tensor.shape, dtype=tensor.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Uninitialized CPU tensors allocated from a structure of `TensorInformation` (`get_data_structure`'s inverse)."""
    return recursively_apply(
        lambda info: torch.empty(info.shape, dtype=info.dtype), data_structure, test_type=is_tensor_information
    )


def find_batch_size(data: Any) -> int:
    """The size of dim 0 of the first tensor found (first item of sequences, first value of mappings).

    Raises:
        ValueError: an empty container is met first.
        TypeError: the first leaf is not a tensor.
    """
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size from empty {type(data)}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Can only find the batch size of tensors but got {type(data)}.")
    return data.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """`find_batch_size`, or None where it would raise."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def batch_rows(data: Any) -> int:
    """The size of dim 0 of the first tensor of `data` that has a dim, searching the whole structure; 0 when
    there is none. Unlike `find_batch_size` it never raises: the dispatcher counts the rows of any batch."""
    return next((tensor.shape[0] for tensor in _tensors_in(data) if tensor.dim() > 0), 0)


def _tensors_in(data: Any) -> Iterator[torch.Tensor]:
    """The tensors of `data` in `recursively_apply`'s order, other leaves skipped (`tensor_leaves` raises)."""
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, (tuple, list, Mapping)):
        for child in data.values() if isinstance(data, Mapping) else data:
            yield from _tensors_in(child)


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in a nested list/tuple/mapping, or None."""
    return next((tensor.device for tensor in _tensors_in(data)), None)


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Every tensor with a dim indexed with `tensor_slice` (`process_index`/`num_processes` are unused, as in HF).

    0-dim tensors are kept as they are (HF Accelerate raises IndexError on them), so the dispatcher, whose
    default `slice_fn` this is, can slice batches that carry a scalar.
    """
    return recursively_apply(lambda tensor: tensor[tensor_slice] if tensor.dim() > 0 else tensor, data)


def listify(data: Any) -> Any:
    """Every tensor turned into (nested) Python numbers on the CPU; bfloat16 goes through float32."""

    def to_list(tensor):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()

    return recursively_apply(to_list, data)


def _concatenate(data: list | tuple, dim: int, other_leaves: Callable[[list], Any]) -> Any:
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (_concatenate([d[i] for d in data], dim, other_leaves) for i in range(len(first))))
    if isinstance(first, Mapping):
        return _rebuild_mapping(
            first, {key: _concatenate([d[key] for d in data], dim, other_leaves) for key in first.keys()}
        )
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    return other_leaves(list(data))


def _only_item(items: list) -> Any:
    if len(items) == 1:
        return items[0]
    raise TypeError(f"Can only concatenate tensors but got {type(items[0])}")


def concatenate(data: list | tuple, dim: int = 0) -> Any:
    """Concatenates a list of structures of the same shape, leaf by leaf, along `dim`.

    Args:
        data: Structures (tensors, or nested lists/tuples/mappings of tensors) that match each other.
        dim: The dim to concatenate along.

    Returns:
        One structure of `data[0]`'s type; a list holding one non-tensor item gives that item.

    Raises:
        TypeError: a leaf of several structures is not a tensor.

    Example::

        concatenate([{"x": torch.zeros(2, 3)}, {"x": torch.ones(1, 3)}])   # {"x": tensor of shape (3, 3)}
    """
    return _concatenate(data, dim, _only_item)


def concatenate_batches(batches: list) -> Any:
    """The batches (structures of the same shape) joined along dim 0, leaf by leaf, as `concatenate` does, except
    that a leaf that is not a tensor is taken from the first batch instead of raising (the dispatcher carries such
    leaves through)."""
    return _concatenate(batches, 0, lambda items: items[0])


def is_torch_xpu_tensor(tensor: Any) -> bool:
    """Whether `tensor` is a tensor on an Intel GPU (HF's check is broken: it always raises TypeError)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"


def merge_dicts(source: Mapping, destination: dict) -> dict:
    """Merges `source` into `destination` in place, nested dicts key by key (`source`'s values win elsewhere).

    Example::

        merge_dicts({"a": {"x": 1}}, {"a": {"y": 2}, "b": 3})   # {"a": {"y": 2, "x": 1}, "b": 3}
    """
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def _is_half_precision(value: Any) -> bool:
    return getattr(value, "dtype", None) in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Every float16/bfloat16 tensor (or object with such a `dtype` and a `.float()`) of a nested
    list/tuple/mapping made float32; other leaves unchanged.

    Example::

        convert_to_fp32({"logits": torch.ones(2, dtype=torch.bfloat16), "ids": torch.ones(2, dtype=torch.int64)})
        # {"logits": float32 tensor, "ids": the same int64 tensor}
    """
    return recursively_apply(lambda value: value.float(), tensor, test_type=_is_half_precision)


class ConvertOutputsToFp32:
    """A callable (a model's forward) whose outputs come back with float16/bfloat16 tensors made float32.

    A model whose forward is wrapped this way cannot be pickled (the wrapper refuses, as in HF): unwrap it first
    (`Accelerator.unwrap_model(model)` or `extract_model_from_parallel(model, keep_fp32_wrapper=False)`).
    """

    def __init__(self, model_forward: Callable):
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise pickle.PicklingError(
            "Cannot pickle a prepared model with automatic mixed precision, please unwrap the model with "
            "`Accelerator.unwrap_model(model)` before pickling it."
        )


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    """`model_forward` wrapped by `ConvertOutputsToFp32`, as a function whose `__wrapped__` is that wrapper (so that
    `extract_model_from_parallel(keep_fp32_wrapper=False)` can find the original forward again)."""
    converting = ConvertOutputsToFp32(model_forward)

    def forward(*args, **kwargs):
        return converting(*args, **kwargs)

    forward.__wrapped__ = converting
    return forward
