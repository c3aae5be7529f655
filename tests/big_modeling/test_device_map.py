"""get_max_memory, get_balanced_memory and infer_auto_device_map: placement is planning only, so GPU indices
can be planned for on a CPU machine."""

import pytest
import torch
from torch import nn

from accel.big_modeling import get_balanced_memory, get_max_memory, infer_auto_device_map, init_empty_weights

transformers = pytest.importorskip("transformers")
LAYER = 100 * 100 * 4 + 100 * 4  # one Linear(100, 100) in fp32: 40,400 bytes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(100, 100), nn.Linear(100, 100)


def device_of(device_map, tensor_name):
    """The device of a tensor: the entry of the longest prefix of its name."""
    matches = [n for n in device_map if n == "" or tensor_name == n or tensor_name.startswith(n + ".")]
    return device_map[max(matches, key=len)]


def test_get_max_memory_reads_sizes_and_orders_devices():
    assert list(get_max_memory({"cpu": "1GiB", 1: "2GB", "disk": 5, 0: 1000})) == [0, 1, "cpu", "disk"]
    assert get_max_memory({"cpu": "1GiB", 1: "2GB"}) == {1: 2 * 10**9, "cpu": 2**30}
    with pytest.raises(ValueError, match="unknown device"):
        get_max_memory({"tpu": 1})
    with pytest.raises(ValueError, match="cannot read '12 apples'"):
        get_max_memory({"cpu": "12 apples"})
    assert get_max_memory()["cpu"] > 0  # defaults: free GPU memory and available RAM


def test_layers_fill_gpus_in_order_then_the_cpu_with_room_kept_for_offloaded_layers():
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])
    # GPUs of 2 layers each, but with offloading the main GPU (where offloaded layers run) keeps room for the
    # largest layer: one layer there, two on GPU 1, the rest on the CPU.
    device_map = infer_auto_device_map(model, max_memory={0: 2 * LAYER + 10, 1: 2 * LAYER + 10, "cpu": 10 * LAYER})
    assert device_map == {"0": 0, "1": 1, "2": 1, "3": "cpu"}
    # Without offloading the whole room is used; adjacent layers on one device stay separate entries of the
    # Sequential (the model itself is the root).
    assert infer_auto_device_map(model, max_memory={0: 2 * LAYER + 10, 1: 2 * LAYER + 10}) == {
        "0": 0, "1": 0, "2": 1, "3": 1}  # fmt: skip


def test_a_no_split_module_moves_whole_to_the_next_device():
    model = nn.Sequential(nn.Linear(100, 100), Block(), Block())
    budget = {0: 2 * LAYER + 10, 1: 4 * LAYER}
    split = infer_auto_device_map(model, max_memory=budget)
    assert split["1.a"] == 0 and split["1.b"] == 1  # block 1 split over two devices
    whole = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block"])
    assert whole == {"0": 0, "1": 1, "2": 1}


def test_a_model_that_fits_nowhere_says_how_much_is_missing():
    model = nn.Sequential(nn.Linear(100, 100), Block())
    with pytest.raises(ValueError, match=r"max_memory is too small: \d+ more bytes are needed for 1 .*'1', takes 80800"):
        infer_auto_device_map(model, max_memory={0: 2 * LAYER, "cpu": LAYER}, no_split_module_classes=["Block"])


def test_clean_result_merges_children_on_one_device():
    model = nn.Sequential(Block(), nn.Linear(100, 100))
    merged = infer_auto_device_map(model, max_memory={0: 10 * LAYER})
    assert merged == {"0": 0, "1": 0}
    raw = infer_auto_device_map(model, max_memory={0: 2 * LAYER + 10, 1: 10 * LAYER}, clean_result=False)
    assert raw == {"0": 0, "1": 1}


def test_tied_weights_stay_on_one_device_in_gpt2():
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    with init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    embeddings = (1000 + 64) * 64 * 4
    room = 1000 * 64 * 4  # the main GPU keeps room for the largest unsplittable part (wte) while offloading
    device_map = infer_auto_device_map(model, max_memory={0: room + embeddings + block + 100, 1: 2 * block + 100,
                                                          "cpu": 10**8}, no_split_module_classes=["GPT2Block"])  # fmt: skip
    assert device_of(device_map, "transformer.h.0.attn.c_attn.weight") == 0
    assert device_of(device_map, "transformer.h.2.attn.c_attn.weight") == 1
    assert device_of(device_map, "transformer.h.3.attn.c_attn.weight") == "cpu"
    assert device_of(device_map, "lm_head.weight") == device_of(device_map, "transformer.wte.weight")
    assert len({device_of(device_map, f"transformer.h.{i}.attn.c_attn.weight") for i in range(4)}) > 1
    for i in range(4):  # a block is never split
        assert len({device_of(device_map, n) for n, _ in model.transformer.h[i].named_parameters(prefix=f"transformer.h.{i}")}) == 1


def test_balanced_memory_spreads_the_model_over_the_gpus():
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(8)])
    balanced = get_balanced_memory(model, max_memory={0: 10**8, 1: 10**8, "cpu": 10**9})
    assert balanced[0] == 4 * LAYER + LAYER and balanced[1] == 10**8 and balanced["cpu"] == 10**9  # last GPU: all
    low_zero = get_balanced_memory(model, max_memory={0: 10**8, 1: 10**8, 2: 10**8}, low_zero=True)
    assert low_zero[0] == LAYER and low_zero[1] == 4 * LAYER + LAYER and low_zero[2] == 10**8
    device_map = infer_auto_device_map(model, max_memory={0: 5 * LAYER, 1: 5 * LAYER})
    assert sorted(set(device_map.values())) == [0, 1]
    assert get_balanced_memory(model, max_memory={"cpu": 10**9}) == {"cpu": 10**9}  # one device: unchanged


class SharedEmbedding(nn.Module):
    """T5/BART-style: one embedding shared by an encoder and a decoder that are much larger than it."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(100, 100)
        self.encoder = nn.Sequential(nn.Embedding(100, 100), nn.Linear(100, 100), nn.Linear(100, 100))
        self.decoder = nn.Sequential(nn.Embedding(100, 100), nn.Linear(100, 100), nn.Linear(100, 100))
        self.encoder[0].weight = self.shared.weight
        self.decoder[0].weight = self.shared.weight


def test_modules_tied_to_a_placed_weight_are_split_rather_than_overfilling_its_device():
    model = SharedEmbedding()
    embedding = 100 * 100 * 4
    device_map = infer_auto_device_map(model, max_memory={0: embedding + LAYER + 10, 1: 10 * LAYER})
    assert device_of(device_map, "encoder.0.weight") == device_of(device_map, "decoder.0.weight") == 0  # with shared
    on_zero = sum(p.numel() * 4 for n, p in model.named_parameters() if device_of(device_map, n) == 0)
    assert on_zero <= embedding + LAYER + 10  # the encoder and decoder did not follow whole
