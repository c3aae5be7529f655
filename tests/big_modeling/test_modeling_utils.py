"""HF's `accelerate.utils.modeling` / `.offload` functions in accel: tied weights, sizes, load_state_dict, the
offload folder's API, state dicts of offloaded models."""

import json
import logging
import os
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from accel.big_modeling import cpu_offload, disk_offload, init_empty_weights, load_checkpoint_and_dispatch
from accel.big_modeling.device_map import fallback_allocate, get_module_size_with_ties
from accel.checkpoint import save_file
from accel.unsupported import UnsupportedFeatureError
from accel.utils.modeling import (
    calculate_maximum_sizes,
    check_device_same,
    check_tied_parameters_on_same_device,
    clean_device_map,
    compute_module_sizes,
    compute_module_total_buffer_size,
    dtype_byte_size,
    find_tied_parameters,
    get_max_layer_size,
    get_module_leaves,
    get_state_dict_offloaded_model,
    id_tensor_storage,
    infer_auto_device_map,
    is_peft_model,
    load_offloaded_weights,
    load_state_dict,
    named_module_tensors,
    retie_parameters,
)
from accel.utils.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)


def tied_model():
    model = nn.Sequential(
        OrderedDict([("linear1", nn.Linear(4, 4)), ("linear2", nn.Linear(4, 4)), ("linear3", nn.Linear(4, 4))])
    )
    model.linear3.weight = model.linear1.weight
    return model


# --- tied weights ------------------------------------------------------------------------------------------------


def test_find_tied_parameters_and_retie():
    model = tied_model()
    groups = find_tied_parameters(model)
    assert groups == [["linear1.weight", "linear3.weight"]]
    model.linear3.weight = nn.Parameter(model.linear3.weight.detach().clone())  # e.g. a hook replaced it
    assert find_tied_parameters(model) == []
    retie_parameters(model, groups)
    assert model.linear3.weight is model.linear1.weight


def test_tied_parameters_on_different_devices_are_reported(caplog):
    with caplog.at_level(logging.WARNING):
        check_tied_parameters_on_same_device([["linear1.weight", "linear3.weight"]], {"linear1": 0, "linear3": "cpu"})
    assert "different devices" in caplog.text
    caplog.clear()
    check_tied_parameters_on_same_device([["a.weight", "b.weight"]], {"": 0})
    assert caplog.text == ""
    with pytest.raises(ValueError, match="does not contain"):
        check_tied_parameters_on_same_device([["a.weight", "b.weight"]], {"a": 0})


# --- sizes -------------------------------------------------------------------------------------------------------


def test_sizes_of_modules_and_dtypes():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)))
    sizes = compute_module_sizes(model)
    assert dtype_byte_size(torch.float16) == 2 and dtype_byte_size(torch.bool) == 1 / 8
    assert dtype_byte_size(torch.float8_e4m3fn) == 1
    buffers = (5 + 5) * 4 + 8  # running mean and var (float32), num_batches_tracked (int64)
    assert compute_module_total_buffer_size(model) == buffers
    assert get_max_layer_size([("0", model[0]), ("1", model[1])], sizes, []) == (100, ["1.0"])
    assert get_max_layer_size([("0", model[0]), ("1", model[1])], sizes, ["Sequential"]) == (sizes["1"], ["1"])
    model._no_split_modules = ["Sequential"]
    assert calculate_maximum_sizes(model) == (sizes[""], (sizes["1"], ["1"]))
    assert get_module_leaves({"": 1, "a": 1, "a.b": 1, "c": 1}) == ["a.b", "c"]


def test_layers_without_parameters_count_as_empty():
    # GPT-2's dropout (a leaf without parameters) made get_max_layer_size raise KeyError('transformer.drop')
    model = nn.Sequential(nn.Dropout(), nn.Linear(3, 4), nn.ReLU())
    assert get_max_layer_size(list(model.named_children()), compute_module_sizes(model), []) == (64, ["1"])
    assert calculate_maximum_sizes(model) == (64, (64, ["1"]))


def test_id_tensor_storage_tells_shared_memory_apart():
    base = torch.zeros(8)
    assert id_tensor_storage(base[:4]) == id_tensor_storage(base[4:])
    assert id_tensor_storage(base) != id_tensor_storage(torch.zeros(8))
    assert id_tensor_storage(torch.empty(3, device="meta"))[1:] == (0, 12)


def test_named_module_tensors_leaves_out_non_persistent_buffers_at_any_depth():
    inner = nn.Module()
    inner.register_buffer("cache", torch.zeros(2), persistent=False)
    inner.register_buffer("kept", torch.zeros(2))
    model = nn.Sequential(inner)
    names = [name for name, _ in named_module_tensors(model, recurse=True, remove_non_persistent=True)]
    assert names == ["0.kept"]


def test_clean_device_map_merges_what_goes_to_one_device():
    assert clean_device_map({"a.0": 0, "a.1": 0, "b.0": 1, "b.1": "cpu"}) == {"b.0": 1, "b.1": "cpu", "a": 0}
    assert clean_device_map({"a.0": 0, "a.1": 0}) == {"": 0}
    assert check_device_same(torch.device("cpu"), torch.device("cpu"))
    assert not check_device_same(torch.device("cpu"), torch.device("meta"))


def test_is_peft_model_of_a_plain_module():
    assert is_peft_model(nn.Linear(2, 2)) is False


# --- load_state_dict ---------------------------------------------------------------------------------------------


def test_load_state_dict_reads_safetensors_to_the_mapped_devices(tmp_path):
    tensors = {"a.weight": torch.randn(3, 2), "b.weight": torch.arange(4), "c": torch.ones(2, dtype=torch.bfloat16)}
    path = os.fspath(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = load_state_dict(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    placed = load_state_dict(path, device_map={"a": "meta", "b": "disk"})
    assert placed["a.weight"].device.type == "meta"
    assert placed["b.weight"].device.type == "cpu" and torch.equal(placed["b.weight"], tensors["b.weight"])
    assert placed["c"].device.type == "cpu"  # under no entry


class Payload:
    """An arbitrary object in a pickle: loading it would run its class's code."""


def test_load_state_dict_refuses_other_frameworks_and_pickles(tmp_path):
    path = os.fspath(tmp_path / "flax.safetensors")
    save_file({"w": torch.ones(2)}, path, metadata={"format": "flax"})
    with pytest.raises(ValueError, match="pt format"):
        load_state_dict(path)
    weights = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(2)}, weights)
    assert torch.equal(load_state_dict(os.fspath(weights))["w"], torch.ones(2))
    torch.save({"w": torch.ones(2), "code": Payload()}, weights)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_state_dict(os.fspath(weights))


# --- the offload folder ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor(2.5),
        torch.arange(6).view(2, 3),
        torch.tensor([True, False]),
        torch.randn(4).to(torch.float8_e4m3fn),
    ],
)
def test_offload_round_trip_in_hf_format(tmp_path, tensor):
    index = offload_weight(tensor, "layer.weight", tmp_path, index={})
    save_offload_index(index, tmp_path)
    saved = json.loads((tmp_path / "index.json").read_text())["layer.weight"]
    assert saved == {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    loaded = load_offloaded_weight(tmp_path / "layer.weight.dat", saved)
    assert loaded.dtype == tensor.dtype and torch.equal(
        loaded.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
    )
    # HF reads the file as a numpy memmap of the raw bytes (bf16 as int16, float8 as int8, 0-d as one element).
    raw = np.fromfile(tmp_path / "layer.weight.dat", dtype=np.uint8)
    assert raw.tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_offloaded_weights_loader_serves_memory_folder_and_safetensors(tmp_path):
    state_dict = {"a": torch.randn(2, 2), "b": torch.randn(3)}
    index = offload_state_dict(tmp_path / "folder", state_dict)
    assert set(index) == {"a", "b"}
    save_file({"stored": torch.arange(3.0)}, os.fspath(tmp_path / "w.safetensors"))
    loader = OffloadedWeightsLoader(state_dict={"c": torch.zeros(1)}, save_folder=tmp_path / "folder")
    loader.index["d"] = {
        "safetensors_file": os.fspath(tmp_path / "w.safetensors"),
        "weight_name": "stored",
        "dtype": "float16",
    }
    loader.all_keys.append("d")
    assert sorted(loader) == ["a", "b", "c", "d"] and len(loader) == 4
    assert torch.equal(loader["a"], state_dict["a"]) and torch.equal(loader["c"], torch.zeros(1))
    assert loader["d"].dtype == torch.float16 and torch.equal(loader["d"], torch.arange(3.0).half())
    with pytest.raises(ValueError, match="Need either"):
        OffloadedWeightsLoader()
    prefixed = PrefixedDataset({"x.w": 1, "x.b": 2, "y.w": 3}, "x.")
    assert prefixed["w"] == 1 and sorted(prefixed) == ["b", "w"] and len(prefixed) == 2
    assert extract_submodules_state_dict({"h.1.w": 1, "h.10.w": 2, "h.1": 3}, ["h.1"]) == {"h.1.w": 1, "h.1": 3}


def test_load_offloaded_weights_fills_an_empty_model(tmp_path):
    model = nn.Linear(3, 2)
    index = offload_state_dict(tmp_path, model.state_dict())
    with init_empty_weights():
        empty = nn.Linear(3, 2)
    load_offloaded_weights(empty, index, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(empty.state_dict()[name], tensor)
    save_offload_index({}, tmp_path / "nothing")  # an empty index writes nothing (not even the folder)
    assert not (tmp_path / "nothing").exists()


# --- offloaded models --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_state_dict_of_an_offloaded_model(tmp_path, offload):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    if offload == "cpu":
        cpu_offload(model, "cpu")
    else:
        disk_offload(model, tmp_path, "cpu")
    assert model[0].weight.device.type == "meta"
    collected = get_state_dict_offloaded_model(model)
    assert collected.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(collected[name], tensor), name
    assert model[0].weight.device.type == "meta"  # brought in one module at a time, and dropped again


# --- infer_auto_device_map's HF options --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)


def test_fallback_allocation_fills_a_device_the_next_block_does_not_fit():
    model = nn.Sequential(Block(32), nn.Linear(4, 4), Block(32))
    block = compute_module_sizes(model)["0"]
    max_memory = {0: block + 200, "cpu": 10**7}  # GPU 0 keeps room for a block (offloaded), plus 200 bytes
    assert infer_auto_device_map(model, max_memory, ["Block"]) == {"": "cpu"}
    device_map = infer_auto_device_map(model, max_memory, ["Block"], fallback_allocation=True)
    assert device_map == {"1": 0, "0": "cpu", "2": "cpu"}  # a 80-byte linear layer fits in the 200 bytes
    name, module, rest = fallback_allocate([("0", model[0]), ("1", model[1])], compute_module_sizes(model), 100)
    assert (name, module, rest) == ("1", model[1], [("0", model[0])])
    sizes = {"x": 10, "y": 30, "y.w": 20}
    assert get_module_size_with_ties(["y.w"], 10, sizes, [("y", None)]) == (20, ["y"], [None])


def test_buffers_of_offloaded_modules_that_fit_no_gpu_are_warned_about():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(1000))
    linear = compute_module_sizes(model)["0"]
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        infer_auto_device_map(model, {0: linear + 100, "cpu": 10**7})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_auto_device_map(model, {0: linear + 100, "cpu": 10**7}, offload_buffers=True)


def test_load_checkpoint_and_dispatch_without_a_device_map_loads_on_the_cpu_without_hooks(tmp_path):
    model = nn.Linear(3, 2)
    save_file(dict(model.state_dict()), os.fspath(tmp_path / "model.safetensors"))
    with init_empty_weights():
        empty = nn.Linear(3, 2)
    loaded = load_checkpoint_and_dispatch(empty, tmp_path)  # device_map=None, as HF's default
    assert torch.equal(loaded.weight, model.weight) and not hasattr(loaded, "_hf_hook")
    with pytest.raises(UnsupportedFeatureError, match="broadcast_from_rank0"):
        load_checkpoint_and_dispatch(empty, tmp_path, broadcast_from_rank0=True)
