"""The copy of sharded state (FSDP2's DCP folders) that an asynchronous save writes from, made in about the time
of copying its bytes.

Building the trees DCP saves costs more than copying them: for the tests' 3.4 M-parameter GPT-2 on 2 processes,
torch's `get_model_state_dict` and `get_optimizer_state_dict` take ~13 ms and a fresh copy of their tensors ~5 ms
(half of it page faults), against 2.6 ms to copy the same bytes into memory already in use. Between two saves of
one training nothing in those trees changes but the numbers: the same parameter and optimizer-state tensors
(updated in place), under the same names; the param groups' hyper-parameters (a scheduler's lr) are the one part
that changes without a tensor.

So the first asynchronous save of a set of models and optimizers builds the trees with torch's functions and
copies them, as DCP's stager does; `ShardStager` keeps that copy (`Staging`) with the live tensor each copied leaf
came from and a fingerprint of the live state: every parameter, buffer and optimizer-state value, by name, object
and memory address (a value that is not a tensor, by value). A later save whose fingerprint is unchanged copies the
live tensors into the kept copy (one call: accel::stream_copy_, whose non-temporal stores keep the copy, read only
later by the writer, out of the cache, ~1.3x faster than its reference and fallback, torch's foreach copy) and
takes the param groups' values afresh; any other change (a parameter replaced, the optimizer's state created or
grown, a model holding a value that is not a tensor) builds the trees anew. Keeping a copy is the memory an
asynchronous save needs anyway: one copy of the rank's shards, until `release` (end of training).

A save reuses the copy only after the previous one was written: save_state joins an earlier asynchronous save
before it stages the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel.checkpoint import snapshot

Tree = dict  # a state dict's tree: dicts and lists with tensors and other values as leaves


@dataclasses.dataclass
class Staging:
    """A kept copy of the trees, and what refreshing it needs."""

    fingerprint: list
    trees: list[tuple[str, Tree]]  # [(DCP folder name, copied tree)], what the writer writes
    sources: list[torch.Tensor]  # the live tensors the copy's tensors came from (their local shards), in order
    targets: list[torch.Tensor]  # the copy's tensors (local shards), in the same order
    param_groups: list[tuple[list, torch.optim.Optimizer]]  # each copied tree's param groups, and their optimizer
    on_cpu: bool  # every source is in CPU memory (the fingerprint holds their addresses, so their devices too)

    def refresh(self) -> list[tuple[str, Tree]]:
        """The trees with the live values: tensors copied into the kept copy, param groups' values taken anew."""
        _copy_into(self.targets, self.sources, self.on_cpu)
        for groups, optimizer in self.param_groups:
            for copied, live in zip(groups, optimizer.param_groups):
                copied.update((key, cpu_copy(value)) for key, value in live.items() if key != "params")
        return self.trees


class ShardStager:
    """The kept copy of one process's sharded state (see the module docstring)."""

    def __init__(self) -> None:
        self._staging: Staging | None = None

    def stage(
        self,
        models: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        build: Callable[[], list[tuple[str, Tree]]],
    ) -> list[tuple[str, Tree]]:
        """A CPU copy of the trees `build` returns for `models` and `optimizers`: the kept copy refreshed when the
        live state has the fingerprint it was made from, else a new copy of `build()`'s trees (kept for the next
        save when it can be refreshed)."""
        fingerprint = _fingerprint(models, optimizers)
        if self._staging is not None and self._staging.fingerprint == fingerprint:
            return self._staging.refresh()
        trees = build()
        memo: dict[tuple, torch.Tensor] = {}  # one copy of a tensor found in several trees or under several names
        copied = [(name, cpu_copy(tree, memo)) for name, tree in trees]
        self._staging = _keepable(fingerprint, trees, copied, optimizers)
        return copied

    def release(self) -> None:
        """Frees the kept copy (end of training)."""
        self._staging = None


def _keepable(
    fingerprint: list,
    trees: list[tuple[str, Tree]],
    copied: list[tuple[str, Tree]],
    optimizers: list[torch.optim.Optimizer],
) -> Staging | None:
    """A Staging of `copied` when refreshing it reproduces what `build` would return while the fingerprint holds:
    every leaf outside the param groups is a tensor or a value the fingerprint holds by value, and each tree's
    param groups are its optimizer's, without their parameters. Else None (every save builds anew)."""
    sources: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    groups: list[tuple[list, torch.optim.Optimizer]] = []
    copied_once: set[int] = set()
    optimizer_trees = iter(optimizers)
    for (_, tree), (_, copy) in zip(trees, copied):
        if "optimizer" in tree:
            optimizer = next(optimizer_trees, None)
            live_groups = tree["optimizer"].get("param_groups")
            if optimizer is None or not _same_groups(live_groups, optimizer):
                return None
            groups.append((copy["optimizer"]["param_groups"], optimizer))
            tree = {"state": tree["optimizer"].get("state", {})}
            copy = {"state": copy["optimizer"].get("state", {})}
        # The fingerprint holds optimizer-state values that are not tensors by value; a model's, nothing.
        plain = (int, float, bool, str, type(None)) if "state" in tree else ()
        for leaf, copied_leaf in zip(_leaves(tree), _leaves(copy)):
            if isinstance(leaf, torch.Tensor):
                if id(copied_leaf) in copied_once:
                    continue  # a tied weight's second name: its copy is refreshed once
                copied_once.add(id(copied_leaf))
                sources.append(_local(leaf))
                targets.append(_local(copied_leaf))
            elif not isinstance(leaf, plain):
                return None  # a value the fingerprint cannot vouch for
    return Staging(fingerprint, copied, sources, targets, groups, all(s.device.type == "cpu" for s in sources))


def _same_groups(groups: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a tree's param groups are `optimizer`'s with their parameters named (what refresh rebuilds)."""
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return False
    return all(
        isinstance(group, dict)
        and set(group) == set(live)
        and all(_same_value(group[key], value) for key, value in live.items() if key != "params")
        for group, live in zip(groups, optimizer.param_groups)
    )


def _same_value(value: Any, live: Any) -> bool:
    if isinstance(live, torch.Tensor) or isinstance(value, torch.Tensor):
        return value is live
    return type(value) is type(live) and value == live


def _fingerprint(models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> list:
    """What must stay the same for a kept copy to be refreshed: each model's modules with their parameters and
    buffers (object, name, object and address of its local shard), each optimizer's groups (their parameters and
    keys) and state (per parameter, each value's key with the tensor's object and address, or the value itself).
    One flat list, each table preceded by its length so that two different states cannot read the same: building
    it costs ~0.7 µs a tensor, nested tuples ~1 µs; the modules' own tables are ~3x faster than named_parameters."""
    marks: list[Any] = []
    for model in models:
        for module in _modules(model):
            marks.append(id(module))
            for table in (module._parameters, module._buffers):
                marks.append(len(table))
                for key, tensor in table.items():
                    marks += (key, id(tensor), None if tensor is None else _local(tensor).data_ptr())
    for optimizer in optimizers:
        marks.append(len(optimizer.param_groups))
        for group in optimizer.param_groups:
            marks += (tuple(map(id, group["params"])), tuple(group))
        marks.append(len(optimizer.state))
        for param, state in optimizer.state.items():
            marks += (id(param), len(state))
            for key, value in state.items():
                marks += (key, *_value_mark(value))
    return marks


def _modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model.modules()`, in its order, without the name `named_modules` builds for each (~40% of its time)."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(reversed(module._modules.values()))
    return found


def _value_mark(value: Any) -> tuple:
    """A tensor by object and address (the kept copy holds the object, so its id is not reused); else the value."""
    if isinstance(value, torch.Tensor):
        return (id(value), _local(value).data_ptr())
    return (type(value), value)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor itself)."""
    return getattr(tensor, "_local_tensor", tensor)


def _copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor], on_cpu: bool) -> None:
    """Copies each source into its target: CPU sources (`on_cpu`) in one call, accel's non-temporal copy (the kept
    copy is read once, by the writer, so its lines need not pass through the cache; its reference and fallback is
    one foreach copy), per tensor for others (a device's tensors into CPU memory)."""
    if on_cpu:
        snapshot.stream_copy(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


def cpu_copy(value: Any, memo: dict[tuple, torch.Tensor] | None = None) -> Any:
    """A copy of a state dict's tree whose tensors are copied into CPU memory now: a DTensor as its local shard's
    copy under the same layout (the DTensor rebuilt around it where it is, as DCP's stager rebuilds it: `from_local`
    would move it back to the mesh's device), containers copied, other leaves deep-copied. DCP's `DefaultStager`
    makes the same copy through a generic deep copy that costs ~15 µs a node: 60 of 67 ms for a 3.4 M-parameter
    GPT-2's model and AdamW state on 2 processes, whose bytes copy in 3 ms. A tensor found twice in the tree (tied
    weights: one parameter under two names, as two views of its memory) is copied once, both names holding the
    copy (`memo`, by the memory and layout the tensor views).
    """
    import copy

    from torch.distributed.tensor import DTensor

    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        key = _memory_key(value)
        if key not in memo:
            memo[key] = _tensor_copy(value, DTensor)
        return memo[key]
    if isinstance(value, dict):
        return {key: cpu_copy(item, memo) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(item, memo) for item in value)
    return copy.deepcopy(value)


def _memory_key(tensor: torch.Tensor) -> tuple:
    """Two tensors with equal keys view the same elements (a DTensor's by its local shard and placement)."""
    local = _local(tensor)
    return (
        local.device,
        local.dtype,
        local.data_ptr(),
        tuple(local.shape),
        local.stride(),
        getattr(tensor, "_spec", None) is not None and str(tensor._spec),
    )


def _tensor_copy(tensor: torch.Tensor, dtensor_type: type) -> torch.Tensor:
    if isinstance(tensor, dtensor_type):
        return dtensor_type(tensor._local_tensor.detach().to("cpu", copy=True), tensor._spec, requires_grad=False)
    return tensor.detach().to("cpu", copy=True)


stager = ShardStager()
