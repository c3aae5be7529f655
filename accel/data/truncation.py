"""`gather_for_metrics` and its truncation: what it drops at the end of the data.

At every step, the batches of processes 0..N-1, concatenated in that order, are the next samples of the epoch in
order (sharding never reorders); only the last step may add copies (to even out the batches), and they come after
the real samples. So `gather` + this truncation returns every sample exactly once, in order.

`gather_for_metrics` walks a pytree of tensors once: its leaves go to one ragged all-gather (on one host, one
native call with one rendezvous for all of them), are cut on the flat list at the last batch, and the pytree is
rebuilt once around them.
"""

from __future__ import annotations

from typing import Any

import torch

from accel import pytree
from accel.collectives import direct, operations
from accel.gradient_state import GradientState

__all__ = ["gather_for_metrics", "gather_for_metrics_truncation"]


def _cut_rows(gradient_state: GradientState) -> tuple[int, int | None] | None:
    """(rows to keep, gathered rows a leaf must have to be cut) at the last batch; None when nothing is cut."""
    if not gradient_state.end_of_dataloader or gradient_state.remainder < 0:
        return None
    return gradient_state.remainder, getattr(gradient_state.active_dataloader, "_last_global_rows", None)


def _cut(values: Any, remainder: int, rows: int | None) -> Any:
    """The first `remainder` items of `values`, when it has the gathered batch's length (`rows`, if known)."""
    if rows is not None and len(values) != rows:
        return values
    return values[:remainder]


def _truncated_leaves(leaves: list[torch.Tensor], gradient_state: GradientState) -> list[torch.Tensor]:
    cut = _cut_rows(gradient_state)
    if cut is None:
        return leaves
    return [_cut(leaf, *cut) if leaf.dim() > 0 else leaf for leaf in leaves]


def gather_for_metrics_truncation(
    gathered: Any, gradient_state: GradientState | None = None, use_gather_object: bool = False
) -> Any:
    """Drops the copies that evened-out last batches added to data already gathered across processes.

    Contract: `gathered` is what `gather` (or `gather_object`) returned for per-sample data of the current
    batch of the active prepared dataloader: every leaf's dim 0 is the processes' batches concatenated in rank
    order. Outside the last batch this returns `gathered` unchanged. At the last batch
    (`gradient_state.end_of_dataloader`), each tensor leaf whose dim 0 has the length the gathered batch has
    at that step is cut to its first `gradient_state.remainder` rows (the real samples; the copies always come
    after them); other leaves (a gathered per-process loss, non-tensors) are returned unchanged, and so is
    everything when the remainder is unknown (-1: an iterable dataset without a length). Sharding never
    reorders samples, so over a full pass the results are every sample exactly once, in order.

    Args:
        gathered: A tensor or a pytree (dict, list, tuple, named tuple) of tensors; with `use_gather_object`,
            the list of per-sample objects `gather_object` returned.
        gradient_state: The state to read (default: the `GradientState` singleton).
        use_gather_object: `gathered` is a flat list of per-sample objects: cut the list itself.

    Example:
        ```python
        # 7 samples, batch_size=2, 2 processes: the last step gathers [4, 5, 6, 0]
        for batch in prepared_loader:
            preds = gather_for_metrics_truncation(gather(model(batch)))  # last step: [4, 5, 6]
        ```
    """
    state = gradient_state if gradient_state is not None else GradientState()
    cut = _cut_rows(state)
    if cut is None:
        return gathered
    if use_gather_object:
        return _cut(gathered, *cut)
    return pytree.recursively_apply(lambda tensor: _cut(tensor, *cut) if tensor.dim() > 0 else tensor, gathered)


def gather_for_metrics(
    input_data: Any, gradient_state: GradientState | None = None, use_gather_object: bool = False
) -> Any:
    """Gathers across processes and drops the samples that sharding duplicated at the end of the data, so an
    evaluation pass sees each sample exactly once (`Accelerator.gather_for_metrics`).

    A tensor or a pytree of tensors is gathered as `gather_ragged` gathers it (last batches may differ in length
    across processes: `even_batches=False`, dispatched batches), then cut as `gather_for_metrics_truncation` cuts
    it. Anything else (a leaf that is not a tensor), or any input with `use_gather_object`, goes through
    `gather_object`, and the gathered list is cut as a whole.

    Args:
        input_data: This process's per-sample results of the current batch.
        gradient_state: The state to read (default: the `GradientState` singleton).
        use_gather_object: Gather `input_data` as picklable objects even when it holds only tensors.

    Returns:
        The gathered data, the structure of `input_data` (a list of items with objects); on one process, the
        cut input (`input_data` itself when nothing is cut).
    """
    state = gradient_state if gradient_state is not None else GradientState()
    flat = None if use_gather_object else direct.flat_leaves(input_data)
    gathered = None if flat is None else direct.all_gather(flat)
    if gathered is not None:  # the direct path: see accel.collectives.direct
        return direct.rebuilt(input_data, _truncated_leaves(gathered, state))
    leaves = None if use_gather_object else _tensors_of(input_data)
    if leaves is None:
        return gather_for_metrics_truncation(operations.gather_object(input_data), state, use_gather_object=True)
    kept = _truncated_leaves(operations.gather_ragged_leaves(leaves), state)
    if kept is leaves:  # one process (the gather returns its input), nothing cut
        return input_data
    return pytree.replace_tensor_leaves(input_data, kept)


def _tensors_of(data: Any) -> list[torch.Tensor] | None:
    """The tensor leaves of `data`, or None when a leaf is not a tensor (any Mapping counts as a container, so
    transformers' BatchEncoding and ModelOutput are gathered as tensors)."""
    try:
        return pytree.tensor_leaves(data, "gather_for_metrics")
    except TypeError:
        return None
