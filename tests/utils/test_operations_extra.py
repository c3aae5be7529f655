"""The rest of HF's `accelerate.utils.operations` in accel: fp32 conversion of outputs, padding inputs to a
multiple of the process count, nested tensors in pad_across_processes, sending one process's tensor to all,
GatheredParameters outside DeepSpeed."""

import pickle
import warnings

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.state import PartialState
from accel.utils import (
    CannotPadNestedTensorWarning,
    GatheredParameters,
    convert_outputs_to_fp32,
    convert_to_fp32,
    copy_tensor_to_devices,
    pad_across_processes,
    pad_input_tensors,
)
from accel.utils.operations import (
    ConvertOutputsToFp32,
    DistributedOperationException,
    chained_operation,
    gather_tensor_shape,
    is_torch_xpu_tensor,
)


def test_convert_to_fp32():
    data = {
        "logits": torch.ones(2, dtype=torch.bfloat16),
        "ids": torch.ones(2, dtype=torch.int64),
        "pair": (torch.ones(1, dtype=torch.float16), "text"),
    }
    converted = convert_to_fp32(data)
    assert converted["logits"].dtype == torch.float32 and converted["pair"][0].dtype == torch.float32
    assert converted["ids"] is data["ids"] and converted["pair"][1] == "text"


def test_convert_outputs_to_fp32_and_pickling():
    def forward(x):
        return {"y": x.half()}

    converting = convert_outputs_to_fp32(forward)
    assert converting(torch.ones(2))["y"].dtype == torch.float32
    assert isinstance(converting.__wrapped__, ConvertOutputsToFp32) and converting.__wrapped__.__wrapped__ is forward
    with pytest.raises(pickle.PicklingError, match="unwrap the model"):
        pickle.dumps(converting.__wrapped__)


@pytest.mark.parametrize("rows, processes, padded", [(3, 4, 4), (5, 4, 8), (6, 4, 8), (8, 4, 8), (1, 1, 1), (7, 2, 8)])
def test_pad_input_tensors_to_a_multiple(rows, processes, padded):
    tensor = torch.arange(rows * 2).reshape(rows, 2) + 1
    result = pad_input_tensors({"x": tensor}, batch_size=rows, num_processes=processes)["x"]
    assert result.shape == (padded, 2)
    assert torch.equal(result[:rows], tensor) and not result[rows:].any()


def test_pad_input_tensors_along_another_dim():
    result = pad_input_tensors(torch.ones(2, 3), batch_size=3, num_processes=2, dim=1)
    assert result.shape == (2, 4) and result[:, 3].eq(0).all()
    with pytest.raises(ValueError, match="num_processes"):
        pad_input_tensors(torch.ones(2), batch_size=2, num_processes=0)


def test_small_helpers():
    assert not is_torch_xpu_tensor(torch.ones(1)) and not is_torch_xpu_tensor([1])

    @chained_operation
    def failing():
        raise DistributedOperationException("shapes differ")

    with pytest.raises(DistributedOperationException, match="failing") as error:
        failing()
    assert "shapes differ" in str(error.value.__cause__)


def test_gathered_parameters_does_nothing_outside_deepspeed():
    parameter = torch.nn.Parameter(torch.ones(2))
    with GatheredParameters([parameter], modifier_rank=0):
        parameter.data.add_(1)
    assert parameter.tolist() == [2.0, 2.0]


def test_one_process():
    source = torch.tensor([1.0, -0.0])
    copied = copy_tensor_to_devices(source)
    assert copied is not source and torch.equal(copied, source)
    with pytest.raises(ValueError, match="exactly one process"):
        copy_tensor_to_devices(None)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.warns(CannotPadNestedTensorWarning):
        assert pad_across_processes([nested])[0] is nested


def _operations_on_two_ranks():
    rank = PartialState().process_index
    mine = torch.tensor([[1.5, -0.0, 3.0]], dtype=torch.bfloat16) if rank == 1 else None
    copied = copy_tensor_to_devices(mine)
    shape, dtype_code = gather_tensor_shape(mine)
    errors = []
    for given in (None, torch.ones(1)):
        try:
            copy_tensor_to_devices(given)
        except ValueError as error:
            errors.append(str(error).split("; ")[1])
    nested = torch.nested.nested_tensor([torch.ones(rank + 1), torch.ones(2)], layout=torch.jagged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = pad_across_processes({"nested": nested, "rows": torch.ones(rank + 1, 2)})
    return (
        copied.dtype,
        copied.tolist(),
        torch.signbit(copied).tolist(),
        shape.tolist(),
        dtype_code,
        errors,
        padded["nested"] is nested,
        padded["rows"].shape,
        [w.category.__name__ for w in caught],
    )


def test_on_two_ranks():
    results = run_on_ranks(_operations_on_two_ranks, 2)
    assert results[0] == results[1]
    dtype, values, signs, shape, code, errors, nested_kept, rows_shape, caught = results[0]
    assert (dtype, values, signs) == (torch.bfloat16, [[1.5, 0.0, 3.0]], [[False, True, False]])
    assert (shape, code) == ([1, 3], 4)
    assert errors == ["no process passed one", "processes [0, 1] passed one"]
    assert nested_kept and rows_shape == (2, 2) and caught == ["CannotPadNestedTensorWarning"]
