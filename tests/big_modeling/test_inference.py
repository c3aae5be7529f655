"""accel.inference: pipeline parallelism refused with what to use instead; its computing helpers work."""

import pytest
import torch
from torch import nn

from accel.inference import build_pipeline, find_pippy_batch_size, generate_device_map, pippy_forward, prepare_pippy
from accel.unsupported import UnsupportedFeatureError


def test_prepare_pippy_refuses_and_names_the_alternatives():
    with pytest.raises(UnsupportedFeatureError, match="prepare_pippy") as caught:
        prepare_pippy(nn.Linear(2, 2), example_args=(torch.ones(1, 2),))
    assert "load_checkpoint_and_dispatch" in str(caught.value) and "split_between_processes" in str(caught.value)
    with pytest.raises(UnsupportedFeatureError):
        build_pipeline(nn.Linear(2, 2), [], (), {}, 2)
    with pytest.raises(UnsupportedFeatureError):
        pippy_forward(lambda: None, 2, False)


def test_generate_device_map_splits_into_equal_stages():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    device_map = generate_device_map(model, num_processes=2)
    assert [device_map[str(i)] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert generate_device_map(model, 1, max_memory={"cpu": 10**6}) == {str(i): "cpu" for i in range(8)}


def test_find_pippy_batch_size_looks_in_args_then_kwargs():
    assert find_pippy_batch_size((None, torch.ones(3, 2)), {"x": torch.ones(5)}) == 3
    assert find_pippy_batch_size((), {"x": {"ids": torch.ones(4, 1)}}) == 4
    assert find_pippy_batch_size(None, None) is None
