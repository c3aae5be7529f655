"""`accelerate.inference`: pipeline-parallel inference (PiPPy, `torch.distributed.pipelining`).

accel does not run pipeline parallelism: `prepare_pippy` (and the pieces it is built from, `build_pipeline` and
`pippy_forward`) raise `UnsupportedFeatureError` saying what to use instead. The helpers that only compute something
(`generate_device_map`, `find_pippy_batch_size`) work.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from accel.big_modeling import calculate_maximum_sizes, infer_auto_device_map
from accel.formatting import convert_bytes
from accel.pytree import ignorant_find_batch_size
from accel.unsupported import refuse

_INSTEAD = (
    "To run a model too large for one GPU, spread it over the GPUs of one process with "
    "`load_checkpoint_and_dispatch(model, checkpoint, device_map='auto')` (or `dispatch_model`); to use several "
    "processes for throughput, give each a share of the inputs with `PartialState().split_between_processes(inputs)` "
    "and gather the outputs with `gather_object`."
)


def generate_device_map(
    model: nn.Module,
    num_processes: int = 1,
    no_split_module_classes: list[str] | None = None,
    max_memory: dict | None = None,
) -> dict:
    """A device map splitting `model` into `num_processes` contiguous stages of about equal size (stage i on device
    i), uncleaned (one entry per unsplit module), as HF computes the split points of `prepare_pippy`.

    Without `max_memory`, each device gets a share of the model plus its largest layer, rounded up to a whole number
    of its printed unit (`convert_bytes`), with 10% headroom, as HF computes it (HF cannot parse a share under 1 KB;
    accel takes it in bytes). The first device keeps room for the largest layer (`infer_auto_device_map`).
    """
    if num_processes == 1:
        return infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=no_split_module_classes, clean_result=False
        )
    if max_memory is None:
        model_size, (largest_layer, _) = calculate_maximum_sizes(model)
        value, unit = convert_bytes((model_size + largest_layer) / num_processes).split(" ")
        share = f"{math.ceil(float(value)) * 1.1} {unit}" if unit != "bytes" else math.ceil(float(value) * 1.1)
        max_memory = dict.fromkeys(range(num_processes), share)
    return infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=no_split_module_classes, clean_result=False
    )


def find_pippy_batch_size(args: tuple | None, kwargs: dict | None) -> int | None:
    """The batch size of the first tensor found in `args`, then in `kwargs` (None when there is none)."""
    for value in [*(args or ()), *(kwargs or {}).values()]:
        found = ignorant_find_batch_size(value)
        if found is not None:
            return found
    return None


def build_pipeline(model: nn.Module, split_points: list[str], args: tuple, kwargs: dict, num_chunks: int) -> Any:
    """Pipeline stages of `model`: not supported by accel (UnsupportedFeatureError)."""
    raise refuse("Pipeline parallelism (PiPPy)", "accel.inference.build_pipeline(...)", _INSTEAD)


def pippy_forward(forward: Any, num_chunks: int, gather_output: bool, *args: Any, **kwargs: Any) -> Any:
    """A pipeline-parallel forward: not supported by accel (UnsupportedFeatureError)."""
    raise refuse("Pipeline parallelism (PiPPy)", "accel.inference.pippy_forward(...)", _INSTEAD)


def prepare_pippy(
    model: nn.Module,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple | None = (),
    example_kwargs: dict | None = None,
    num_chunks: int | None = None,
    gather_output: bool | None = False,
) -> nn.Module:
    """Wraps `model` for pipeline-parallel inference across processes: not supported by accel.

    Raises:
        UnsupportedFeatureError: always, naming what to use instead (`load_checkpoint_and_dispatch` /
            `dispatch_model` for one model over several GPUs; `split_between_processes` for data parallelism).
    """
    raise refuse("Pipeline parallelism (PiPPy)", "accel.inference.prepare_pippy(...)", _INSTEAD)
