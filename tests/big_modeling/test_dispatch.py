"""load_checkpoint_and_dispatch / dispatch_model with tiny GPT2, BERT and Llama models built from configs: split
between the CPU and the disk (offload folder), outputs equal to the original model's."""

import os

import pytest
import torch
from torch import nn

from accel.big_modeling import (
    add_hook_to_module,
    compute_module_sizes,
    cpu_offload,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    remove_hook_from_module,
)
from accel.big_modeling.hooks import ModelHook
from accel.checkpoint import CheckpointError

transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
    return config, transformers.GPT2LMHeadModel, ["GPT2Block"]


def bert():
    config = transformers.BertConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=500,
        max_position_embeddings=64,
    )
    return config, transformers.BertModel, ["BertLayer"]


def llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=500,
        max_position_embeddings=64,
    )
    return config, transformers.LlamaForCausalLM, ["LlamaDecoderLayer"]


def outputs(model):
    """The model's logits (or last hidden state). Compared at float32 tolerance, not bit for bit: the same weights
    in other memory (a mapped file, the offload folder) can take other CPU kernel paths; CI under load once saw a
    1.9e-6 difference on gpt2."""
    with torch.no_grad():
        result = model(torch.arange(24).reshape(2, 12) % 500)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


@pytest.mark.parametrize("family", [gpt2, bert, llama], ids=["gpt2", "bert", "llama"])
def test_a_model_split_between_cpu_and_disk_computes_what_the_original_does(tmp_path, family):
    config, cls, no_split = family()
    torch.manual_seed(0)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    with init_empty_weights():
        model = cls(config)
    total = compute_module_sizes(model)[""]
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map="sequential",
        max_memory={"cpu": total // 2, "disk": 10**10},
        no_split_module_classes=no_split,
        offload_folder=tmp_path / "offload",
    )
    model.eval()
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    layer = no_split[0]
    for name, module in model.named_modules():  # a no-split block is never split between devices
        if type(module).__name__ == layer:
            assert name in model.hf_device_map or any(name.startswith(k + ".") for k in model.hf_device_map)
    assert os.path.exists(tmp_path / "offload" / "index.json")
    torch.testing.assert_close(outputs(model), outputs(original))


def test_auto_offloads_to_the_disk_what_max_memory_leaves_over(tmp_path):
    """device_map="auto" with a CPU budget smaller than the model: as HF, the disk takes the rest (it is always
    added after the devices given), the CPU keeping room for the largest layer; no offload folder: HF's error."""
    from accel import Accelerator

    config, cls, no_split = gpt2()
    torch.manual_seed(0)
    original = cls(config).eval()
    Accelerator().save_model(original, tmp_path / "ckpt")
    with init_empty_weights():
        model = cls(config)
    kwargs = dict(device_map="auto", no_split_module_classes=no_split, max_memory={"cpu": "600KB"})
    with pytest.raises(
        ValueError, match=r"offloaded to disk \(transformer.h.1, .*\), please pass along an `offload_fo"
    ):
        load_checkpoint_and_dispatch(model, tmp_path / "ckpt", **kwargs)
    model = load_checkpoint_and_dispatch(model, tmp_path / "ckpt", offload_folder=tmp_path / "offload", **kwargs).eval()
    on_cpu = ["transformer.wte", "lm_head", "transformer.wpe", "transformer.drop", "transformer.h.0"]
    on_disk = ["transformer.h.1", "transformer.h.2", "transformer.h.3", "transformer.ln_f"]
    assert model.hf_device_map == dict.fromkeys(on_cpu, "cpu") | dict.fromkeys(on_disk, "disk")
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta"  # read from the folder for its forward
    torch.testing.assert_close(outputs(model), outputs(original))


def test_gpt2_generates_the_same_tokens_when_offloaded(tmp_path):
    config, cls, no_split = gpt2()
    torch.manual_seed(0)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt")
    with init_empty_weights():
        model = cls(config)
    device_map = infer_auto_device_map(
        model,
        max_memory={"cpu": compute_module_sizes(model)[""] // 3, "disk": 10**10},
        no_split_module_classes=no_split,
    )
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), original.generate(prompt, **kwargs))


def test_errors_name_the_problem(tmp_path):
    config, cls, no_split = gpt2()
    cls(config).save_pretrained(tmp_path / "ckpt")
    with init_empty_weights():
        model = cls(config)
    with pytest.raises(ValueError, match="does not have: transformer.nope"):
        load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map={"transformer.nope": "cpu", "": "cpu"})
    half = compute_module_sizes(model)[""] // 2  # the rest goes to the disk, which needs a folder (before loading)
    with pytest.raises(
        ValueError,
        match=r"offloaded to disk \(transformer.ln_f, transformer.h\), please pass along an "
        "`offload_folder`",
    ):
        load_checkpoint_and_dispatch(
            model,
            tmp_path / "ckpt",
            device_map="sequential",
            max_memory={"cpu": half},
            no_split_module_classes=no_split,
        )
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ValueError, match=r"offloaded to disk \(''\), please pass along an `offload_folder`"):
        load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map={"": "disk"})
    with pytest.raises(ValueError, match="need an `offload_dir`.* need to be offloaded: transformer.h.1"):
        dispatch_model(model, {"transformer.h.1": "disk", "": "cpu"})
    other = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=500, n_positions=64)
    with init_empty_weights():
        wrong = cls(other)
    with pytest.raises(CheckpointError, match="tensor 'transformer.wte.weight'.*another architecture"):
        load_checkpoint_and_dispatch(wrong, tmp_path / "ckpt", device_map={"": "cpu"})


def test_missing_weights_warn_or_raise_when_strict(tmp_path):
    config, cls, _ = gpt2()
    state = cls(config).state_dict()
    state.pop("transformer.ln_f.bias")
    state["transformer.extra"] = torch.zeros(2)
    from accel.checkpoint import save_state_dict

    save_state_dict(state, tmp_path / "ckpt")
    with init_empty_weights():
        model = cls(config)
    with pytest.raises(
        CheckpointError,
        match="missing from the checkpoint: transformer.ln_f.bias; in the checkpoint "
        "but not in the model: transformer.extra",
    ):
        load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map={"": "cpu"}, strict=True)


def test_cpu_offload_and_disk_offload_keep_the_outputs(tmp_path):
    config, cls, _ = gpt2()
    torch.manual_seed(1)
    original = cls(config).eval()
    expected = outputs(original)
    for offload in ("cpu", "disk"):
        torch.manual_seed(1)
        model = cls(config).eval()
        model = cpu_offload(model, "cpu") if offload == "cpu" else disk_offload(model, tmp_path / "off", "cpu")
        assert model.transformer.h[0].attn.c_attn.weight.device.type == "meta"  # weights come in per forward
        torch.testing.assert_close(outputs(model), expected)


def test_hooks_wrap_and_unwrap_forward():
    class Double(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    layer = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    plain = layer(x)
    add_hook_to_module(layer, Double())
    assert torch.equal(layer(x), plain * 2)
    add_hook_to_module(layer, Double(), append=True)
    assert torch.equal(layer(x), plain * 4)
    remove_hook_from_module(layer)
    assert torch.equal(layer(x), plain) and "forward" not in layer.__dict__


def test_dispatch_model_on_one_device_just_moves_the_model():
    model = nn.Sequential(nn.Linear(2, 2))
    assert dispatch_model(model, {"": "cpu"}).hf_device_map == {"": "cpu"}
    assert "_hf_hook" not in model.__dict__


def test_cpu_weights_map_the_file_privately_and_never_write_it(tmp_path):
    from safetensors import safe_open

    config, cls, _ = gpt2()
    torch.manual_seed(2)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt")
    with init_empty_weights():
        model = cls(config)
    model = load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map={"": "cpu"}).eval()
    torch.testing.assert_close(outputs(model), outputs(original))
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.add_(1.0)  # copy-on-write: this process only
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert torch.equal(
            f.get_tensor("transformer.h.0.attn.c_attn.weight"), original.transformer.h[0].attn.c_attn.weight
        )


def test_a_file_others_may_write_is_mapped_under_the_same_lease(tmp_path):
    """The lease guards against every writer, other users included (test_mapped_weights.py has the writers)."""
    from test_mapped_weights import backing_file

    config, cls, _ = gpt2()
    cls(config).save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    os.chmod(path, 0o666)
    with init_empty_weights():
        model = cls(config)
    model = load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map={"": "cpu"})
    assert backing_file(model.transformer.h[0].attn.c_attn.weight) == str(path)


@pytest.mark.gpu
def test_a_split_over_the_gpu_the_cpu_and_the_disk(tmp_path):
    config, cls, no_split = gpt2()
    torch.manual_seed(0)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    with init_empty_weights():
        model = cls(config)
    third = compute_module_sizes(model)[""] // 3
    # HF's planner keeps room on the CPU for the largest block offloaded beyond it: a third would hold none.
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map="sequential",
        max_memory={0: third * 2, "cpu": third * 3 // 2, "disk": 10**10},
        no_split_module_classes=no_split,
        offload_folder=tmp_path / "offload",
    ).eval()
    assert set(model.hf_device_map.values()) == {0, "cpu", "disk"}
    result = outputs(model)
    assert result.device.type == "cpu"  # back where the input came from
    torch.testing.assert_close(result, outputs(original), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", [gpt2, llama], ids=["gpt2", "llama"])
def test_auto_spreads_over_the_gpu_the_cpu_and_the_disk(tmp_path, family):
    """device_map="auto" with room for half the model on the GPU and half in RAM (each less the largest block, kept
    for offloaded ones, as HF plans): the map is HF Accelerate's, every tensor placed on the GPU holds the
    checkpoint's bits, offloaded ones come to the GPU for their forward, outputs come back where the input was
    (CPU or GPU) and equal the original's."""
    config, cls, no_split = family()
    torch.manual_seed(0)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    saved = {name: t.clone() for name, t in original.state_dict().items()}
    with init_empty_weights():
        model = cls(config)
    size = compute_module_sizes(model)[""]
    budget = {0: size // 2, "cpu": size // 2, "disk": 10**10}
    hf_utils = pytest.importorskip("accelerate.utils")  # HF Accelerate 1.15, for the map it would make
    hf_map = hf_utils.infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split)
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map="auto",
        max_memory=budget,
        no_split_module_classes=no_split,
        offload_folder=tmp_path / "offload",
    )
    model.eval()
    assert set(model.hf_device_map.values()) == {0, "cpu", "disk"} and model.hf_device_map == hf_map
    on_gpu = {name: t for name, t in model.state_dict().items() if t.is_cuda}
    assert on_gpu and all(torch.equal(t.cpu(), saved[name]) for name, t in on_gpu.items())
    expected = outputs(original)
    result = outputs(model)
    assert result.device.type == "cpu"
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        on_device = model(torch.arange(24, device="cuda").reshape(2, 12) % 500)
    on_device = on_device.logits if hasattr(on_device, "logits") else on_device.last_hidden_state
    assert on_device.is_cuda
    torch.testing.assert_close(on_device.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_auto_puts_a_model_that_fits_on_the_gpu_whole(tmp_path):
    config, cls, no_split = gpt2()
    torch.manual_seed(0)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt")
    with init_empty_weights():
        model = cls(config)
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "ckpt", device_map="auto", no_split_module_classes=no_split
    ).eval()
    assert set(model.hf_device_map.values()) == {0}
    assert all(t.is_cuda for t in model.state_dict().values())
    assert all(torch.equal(t.cpu(), original.state_dict()[name]) for name, t in model.state_dict().items())


def test_a_bin_checkpoint_loads_with_weights_only(tmp_path):
    config, cls, no_split = gpt2()
    torch.manual_seed(3)
    original = cls(config).eval()
    original.save_pretrained(tmp_path / "ckpt", safe_serialization=False, max_shard_size="200KB")
    with init_empty_weights():
        model = cls(config)
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map="sequential",
        max_memory={"cpu": compute_module_sizes(model)[""] // 2, "disk": 10**10},
        no_split_module_classes=no_split,
        offload_folder=tmp_path / "off",
    ).eval()
    torch.testing.assert_close(outputs(model), outputs(original))


def test_persistent_buffers_of_disk_modules_stay_in_memory_and_hooked_models_deepcopy(tmp_path):
    import copy

    from accel.checkpoint import save_state_dict

    torch.manual_seed(4)
    original = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()
    original[1].running_mean.uniform_()
    save_state_dict(original.state_dict(), tmp_path / "ckpt")
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "ckpt", device_map={"0": "cpu", "1": "disk", "2": "disk"}, offload_folder=tmp_path / "off"
    ).eval()
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), original(x), rtol=0, atol=0)
    assert model[1].running_mean.device.type == "cpu"  # a buffer: not offloaded without offload_buffers
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), original(x), rtol=0, atol=0)
    assert twin[0].forward.func.__name__ == "_hooked_forward" and twin[0].forward.args[0] is twin[0]
