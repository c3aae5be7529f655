"""`gather_for_metrics_truncation`: what `gather_for_metrics` drops at the end of the data.

At every step, the batches of processes 0..N-1, concatenated in that order, are the next samples of the epoch in
order (sharding never reorders); only the last step may add copies (to even out the batches), and they come after
the real samples. So `gather` + this truncation returns every sample exactly once, in order.
"""

from __future__ import annotations

from typing import Any

from accel import pytree
from accel.gradient_state import GradientState

__all__ = ["gather_for_metrics_truncation"]


def gather_for_metrics_truncation(gathered: Any, gradient_state: GradientState | None = None,
                                  use_gather_object: bool = False) -> Any:
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
    if not state.end_of_dataloader or state.remainder < 0:
        return gathered
    remainder = state.remainder
    rows = getattr(state.active_dataloader, "_last_global_rows", None)

    def cut(values):
        if rows is not None and len(values) != rows:
            return values
        return values[:remainder]

    if use_gather_object:
        return cut(gathered)
    return pytree.recursively_apply(lambda tensor: cut(tensor) if tensor.dim() > 0 else tensor, gathered)
