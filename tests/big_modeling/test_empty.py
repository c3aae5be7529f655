"""init_empty_weights / init_on_device (with real transformers models built from configs) and
compute_module_sizes."""

import pytest
import torch
from torch import nn

import accel
from accel.big_modeling import compute_module_sizes, init_empty_weights, init_on_device

transformers = pytest.importorskip("transformers")


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("table", torch.arange(5.0))


def test_parameters_land_on_meta_and_buffers_stay_by_default():
    with accel.init_empty_weights():
        module = WithBuffer()
    assert all(p.device.type == "meta" for p in module.parameters())
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in module.parameters())
    assert module.table.device.type == "cpu" and module.table.tolist() == [0, 1, 2, 3, 4]
    assert module.norm.running_mean.device.type == "cpu"


def test_include_buffers_puts_buffers_on_meta_too(monkeypatch):
    with init_empty_weights(include_buffers=True):
        module = WithBuffer()
    assert all(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "1")  # HF's variable is honoured
    with init_empty_weights():
        module = WithBuffer()
    assert module.table.device.type == "meta"


def test_the_patch_is_undone_even_when_the_body_raises():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), init_empty_weights():
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_a_frozen_parameter_stays_frozen_and_attributes_survive():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            param = nn.Parameter(torch.ones(3), requires_grad=False)
            param._is_hf_initialized = True
            self.register_parameter("w", param)

    with init_empty_weights():
        module = Frozen()
    assert module.w.device.type == "meta" and not module.w.requires_grad and module.w._is_hf_initialized


def test_init_on_device_cpu_keeps_values():
    torch.manual_seed(0)
    expected = nn.Linear(3, 3).weight.detach().clone()
    torch.manual_seed(0)
    with init_on_device("cpu"):
        layer = nn.Linear(3, 3)
    assert torch.equal(layer.weight, expected)


@pytest.mark.parametrize("build", ["constructor", "from_config"])
def test_a_transformers_model_is_built_without_its_weights(build):
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    with init_empty_weights():
        if build == "constructor":
            model = transformers.GPT2LMHeadModel(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.lm_head.weight is model.transformer.wte.weight  # tying still works on meta tensors


def test_compute_module_sizes_counts_every_module_and_tied_weights_once():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    with init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    sizes = compute_module_sizes(model)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert sizes[""] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "lm_head.weight" not in sizes  # tied to wte: counted once, under its first name
    assert sizes["transformer.h.0"] == sum(
        t.numel() * 4 for n, t in tensors.items() if n.startswith("transformer.h.0.")
    )
    assert sizes["transformer.wte.weight"] == 100 * 32 * 4


def test_compute_module_sizes_with_dtypes():
    model = nn.Sequential(nn.Linear(4, 4), nn.Embedding(10, 4))
    model.register_buffer("ids", torch.arange(6))
    half = compute_module_sizes(model, dtype=torch.float16)
    assert half["0.weight"] == 16 * 2 and half["ids"] == 6 * 8  # integers keep their size
    assert compute_module_sizes(model.half(), dtype="float32")["0.weight"] == 16 * 2  # never widened
    special = compute_module_sizes(model, dtype=torch.float16, special_dtypes={"1.weight": torch.float32})
    assert special["1.weight"] == 40 * 4 and special["1"] == 40 * 4
