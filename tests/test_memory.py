"""accel.memory: find_executable_batch_size, should_reduce_batch_size and release_memory.

Out-of-memory is simulated by raising the errors the allocators raise; no memory is exhausted.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from accel.memory import find_executable_batch_size, release_memory, should_reduce_batch_size

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"


def _fits_at_most(limit: int, tried: list[int]):
    """A training function that runs out of memory above `limit` and records each batch size it is given."""

    def train(batch_size, model, lr=0.1):
        tried.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return batch_size, model, lr

    return train


def test_shrinks_the_batch_size_by_a_tenth_after_out_of_memory():
    tried = []
    train = find_executable_batch_size(_fits_at_most(100, tried), starting_batch_size=128)
    assert train("model", lr=0.5) == (92, "model", 0.5)
    assert tried == [128, 115, 103, 92]


def test_keeps_the_batch_size_that_worked_for_later_calls():
    tried = []
    train = find_executable_batch_size(_fits_at_most(50, tried), starting_batch_size=64)
    train("model")
    train("model")
    assert tried == [64, 57, 51, 45, 45]


def test_raises_when_the_batch_size_reaches_zero():
    tried = []
    train = find_executable_batch_size(_fits_at_most(0, tried), starting_batch_size=4)
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        train("model")
    assert tried == [4, 3, 2, 1]


def test_honours_reduce_batch_size_fn_as_a_decorator_factory():
    tried = []
    sizes = iter([90, 80])

    @find_executable_batch_size(starting_batch_size=100, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 80:
            raise RuntimeError("CUDA error: out of memory.")
        return batch_size

    assert train() == 80
    assert tried == [100, 90, 80]


@pytest.mark.parametrize("error", [ValueError("bad input"), RuntimeError("mat1 and mat2 shapes cannot be multiplied")])
def test_other_errors_pass_through_without_a_retry(error):
    tried = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        tried.append(batch_size)
        raise error

    with pytest.raises(type(error)) as raised:
        train()
    assert raised.value is error
    assert tried == [8]


def test_rejects_a_batch_size_passed_by_the_caller():
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train`.*`train\(model='m'\)`"):
        train(8, "m")
    with pytest.raises(TypeError, match="Batch size was passed into `train`"):
        train("m", batch_size=8)
    assert train("m") == 8
    assert train.__name__ == "train"


def test_varargs_functions_take_any_number_of_arguments():
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, *args):
        return batch_size, args

    assert train(1, 2, 3) == (8, (1, 2, 3))


def test_rejects_a_function_without_a_batch_size_parameter():
    with pytest.raises(TypeError, match="takes no positional parameter"):
        find_executable_batch_size(lambda *, model: model)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError(CUDA_OOM),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("XPU out of memory."),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: not enough memory: you tried"),
        RuntimeError("[enforce fail at CPUAllocator.cpp:64] DefaultCPUAllocator: can't allocate memory: you tried to"),
    ],
)
def test_should_reduce_batch_size_recognises_out_of_memory(error):
    assert should_reduce_batch_size(error)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("CUDA out of memory."),
        RuntimeError("Expected all tensors to be on the same device"),
        RuntimeError("CUDA out of memory.", "a second argument"),
        KeyboardInterrupt(),
    ],
)
def test_should_reduce_batch_size_ignores_other_errors(error):
    assert not should_reduce_batch_size(error)


def test_release_memory_returns_nones_and_frees_what_the_caller_dropped():
    tensor, model = torch.ones(4), torch.nn.Linear(2, 2)
    tensor_ref, model_ref = weakref.ref(tensor), weakref.ref(model)
    tensor, model = release_memory(tensor, model)
    assert (tensor, model) == (None, None)
    gc.collect()
    assert tensor_ref() is None and model_ref() is None
