"""get_max_memory, get_balanced_memory and infer_auto_device_map: placement is planning only, so GPU indices
can be planned for on a CPU machine."""

import warnings

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
    # GPUs of 2 layers each, but the main GPU (where offloaded layers run) keeps room for the largest layer not
    # placed yet: one layer there, two on GPU 1, the rest on the CPU.
    device_map = infer_auto_device_map(model, max_memory={0: 2 * LAYER + 10, 1: 2 * LAYER + 10, "cpu": 10 * LAYER})
    assert device_map == {"0": 0, "1": 1, "2": 1, "3": "cpu"}
    # The disk is always there after the devices given (as HF), so the main GPU keeps that room without a CPU too.
    assert infer_auto_device_map(model, max_memory={0: 2 * LAYER + 10, 1: 2 * LAYER + 10}) == {
        "0": 0,
        "1": 1,
        "2": 1,
        "3": "disk",
    }


def test_a_no_split_module_moves_whole_to_the_next_device():
    model = nn.Sequential(nn.Linear(100, 100), Block(), Block())
    budget = {0: 3 * LAYER + LAYER // 2, 1: 4 * LAYER}  # GPU 0 keeps room for the largest layer
    split = infer_auto_device_map(model, max_memory=budget)
    assert split == {"0": 0, "1.a": 0, "1.b": 1, "2": 1}  # block 1 split over two devices
    whole = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block"])
    assert whole == {"0": 0, "1": 1, "2": 1}  # and the room kept is a block's


def test_what_fits_in_no_memory_given_goes_to_the_disk():
    """HF Accelerate always adds the disk after the devices given: a model larger than max_memory is offloaded
    (never refused), and the CPU keeps room for the largest layer, which a disk-offloaded layer needs there."""
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])
    expected = {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk"}
    assert infer_auto_device_map(model, max_memory={"cpu": 3 * LAYER}) == expected
    assert infer_auto_device_map(model, max_memory={"cpu": 3 * LAYER, "disk": 1}) == expected  # the disk is unlimited
    model = nn.Sequential(nn.Linear(100, 100), Block())
    assert infer_auto_device_map(model, max_memory={0: 2 * LAYER, "cpu": LAYER}, no_split_module_classes=["Block"]) == {
        "": "disk"
    }


def test_clean_result_merges_children_on_one_device():
    model = nn.Sequential(Block(), nn.Linear(100, 100))
    assert infer_auto_device_map(model, max_memory={0: 10 * LAYER}) == {"": 0}  # the whole model, as HF
    assert infer_auto_device_map(model, max_memory={0: 10 * LAYER}, clean_result=False) == {"0": 0, "1": 0}


def test_tied_weights_stay_on_one_device_in_gpt2():
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    with init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    embeddings = (1000 + 64) * 64 * 4
    room = 1000 * 64 * 4  # the main GPU keeps room for the largest unsplittable part (wte) while offloading
    device_map = infer_auto_device_map(
        model,
        max_memory={0: room + embeddings + block + 100, 1: 2 * block + 100, "cpu": 10**8},
        no_split_module_classes=["GPT2Block"],
    )
    assert device_of(device_map, "transformer.h.0.attn.c_attn.weight") == 0
    assert device_of(device_map, "transformer.h.2.attn.c_attn.weight") == 1
    assert device_of(device_map, "transformer.h.3.attn.c_attn.weight") == "cpu"
    assert device_of(device_map, "lm_head.weight") == device_of(device_map, "transformer.wte.weight")
    assert len({device_of(device_map, f"transformer.h.{i}.attn.c_attn.weight") for i in range(4)}) > 1
    for i in range(4):  # a block is never split
        assert (
            len(
                {
                    device_of(device_map, n)
                    for n, _ in model.transformer.h[i].named_parameters(prefix=f"transformer.h.{i}")
                }
            )
            == 1
        )


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


def _models_to_compare():
    """(name, model, no-split classes): plain layers, blocks, tied weights (T5-style and GPT-2's lm_head) and a
    model with non-persistent buffers in a module that gets split (BERT's embeddings)."""
    yield "linears", nn.Sequential(*[nn.Linear(40, 40) for _ in range(6)]), []
    yield "blocks", nn.Sequential(nn.Linear(100, 100), Block(), nn.ReLU(), Block(), nn.LayerNorm(100)), ["Block"]
    yield "shared", SharedEmbedding(), []
    configs = {
        "gpt2": (
            transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=300, n_positions=32),
            transformers.GPT2LMHeadModel,
            ["GPT2Block"],
        ),
        "t5": (
            transformers.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=300),
            transformers.T5ForConditionalGeneration,
            ["T5Block"],
        ),
        "bert": (
            transformers.BertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                vocab_size=300,
                max_position_embeddings=32,
            ),
            transformers.BertModel,
            [],
        ),
    }
    for name, (config, cls, no_split) in configs.items():
        with init_empty_weights():
            yield name, cls(config), no_split


def test_device_maps_are_hf_accelerates():
    """The same model and memory give HF Accelerate 1.15's map: what fits where, what is split, what goes to the
    disk, with and without cleaning, fallback allocation and a dtype (seeded random budgets over device layouts)."""
    hf_modeling = pytest.importorskip("accelerate.utils.modeling")
    import random

    rng = random.Random(0)
    layouts = [["cpu"], [0, "cpu"], [0, 1, "cpu"], [0, 1], [0, "cpu", "disk"]]
    compared = 0
    for name, model, no_split in _models_to_compare():
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        for _ in range(12):
            kwargs = dict(
                max_memory={d: int(total * rng.uniform(0.02, 0.8)) for d in rng.choice(layouts)},
                no_split_module_classes=no_split,
                clean_result=rng.random() < 0.6,
                fallback_allocation=rng.random() < 0.3,
                dtype=rng.choice([None, torch.float16]),
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # HF warns that the GPUs planned for are not here
                expected = hf_modeling.infer_auto_device_map(model, **kwargs)
                got = infer_auto_device_map(model, **kwargs)
            assert dict(got) == dict(expected), (name, kwargs)
            compared += 1
    assert compared == 72
