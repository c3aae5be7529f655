"""save_model / load_checkpoint_in_model in Hugging Face's layout, checked against transformers and
huggingface_hub themselves."""

import json
import logging
import os

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open

from accel.accelerator import Accelerator
from accel.checkpoint import CheckpointError, load_checkpoint_in_model, parse_size, save_state_dict, split_into_shards

transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def logits(model):
    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6)).logits


@pytest.mark.parametrize("max_shard_size", [100, 1000, 4096, 10**9, "2KB", "1MB"])  # hub has no KiB units
def test_shards_split_as_huggingface_hub_splits_them(max_shard_size):
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 600, (40,), generator=generator).tolist()
    state_dict = {f"layer{i}.weight": torch.zeros(size) for i, size in enumerate(sizes)}
    ours, total = split_into_shards(state_dict, max_shard_size, "model{suffix}.safetensors")
    theirs = split_torch_state_dict_into_shards(
        state_dict, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors"
    )
    assert ours == theirs.filename_to_tensors
    assert total == theirs.metadata["total_size"]


def test_parse_size():
    assert parse_size("10GB") == 10**10 and parse_size("5MiB") == 5 * 2**20 and parse_size(123) == 123
    assert parse_size("1.5kb") == 1500
    with pytest.raises(ValueError, match="cannot read '10 parsecs'"):
        parse_size("10 parsecs")


def test_save_model_loads_with_transformers_from_pretrained(tmp_path):
    model = tiny_gpt2()
    accelerator = Accelerator()
    accelerator.save_model(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # tied: saved once
    model.config.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)


def test_sharded_save_model_writes_the_index_and_loads_with_from_pretrained(tmp_path):
    model = tiny_gpt2()
    Accelerator().save_model(model, tmp_path, max_shard_size="20KB")
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    expected_total = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n != "lm_head.weight")
    assert index["metadata"]["total_size"] == expected_total
    model.config.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)


def test_a_new_save_removes_the_shards_of_an_older_one(tmp_path):
    model = tiny_gpt2()
    save_state_dict(model.state_dict(), tmp_path, max_shard_size="10KB")
    assert len(os.listdir(tmp_path)) > 3
    save_state_dict(model.state_dict(), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # before it returns (their blocks: freed later)


@pytest.mark.parametrize("safe_serialization", [True, False])
@pytest.mark.parametrize("max_shard_size", ["30KB", "1GB"])
def test_load_checkpoint_in_model_reads_what_transformers_saved(tmp_path, safe_serialization, max_shard_size):
    source = tiny_gpt2(seed=0)
    source.save_pretrained(tmp_path, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
    target = tiny_gpt2(seed=1)
    assert not torch.equal(logits(target), logits(source))
    load_checkpoint_in_model(target, tmp_path, strict=True)
    torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)
    assert target.lm_head.weight is target.transformer.wte.weight  # still tied


def test_load_checkpoint_in_model_from_one_file_and_from_an_index(tmp_path):
    source = tiny_gpt2(seed=0)
    save_state_dict(source.state_dict(), tmp_path / "one")
    save_state_dict(source.state_dict(), tmp_path / "sharded", max_shard_size="20KB")
    for checkpoint in (tmp_path / "one" / "model.safetensors", tmp_path / "sharded" / "model.safetensors.index.json"):
        target = tiny_gpt2(seed=2)
        load_checkpoint_in_model(target, checkpoint, strict=True)
        torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)


def test_dtype_converts_the_floating_point_weights(tmp_path):
    source = tiny_gpt2()
    save_state_dict(source.state_dict(), tmp_path)
    target = tiny_gpt2(seed=3)
    load_checkpoint_in_model(target, tmp_path, dtype=torch.float16)
    assert target.transformer.h[0].attn.c_attn.weight.dtype == torch.float16
    torch.testing.assert_close(
        target.transformer.h[0].attn.c_attn.weight.float(),
        source.transformer.h[0].attn.c_attn.weight.half().float(),
        rtol=0,
        atol=0,
    )


def test_missing_and_unexpected_names_raise_when_strict_and_warn_otherwise(tmp_path, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state_dict = model.state_dict()
    state_dict.pop("1.bias")
    state_dict["extra.weight"] = torch.zeros(2)
    save_state_dict(state_dict, tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"missing from the checkpoint: 1\.bias; in the checkpoint but not in "
        r"the model: extra\.weight",
    ):
        load_checkpoint_in_model(model, tmp_path, strict=True)
    with caplog.at_level(logging.WARNING):
        load_checkpoint_in_model(model, tmp_path)
    assert "missing from the checkpoint: 1.bias" in caplog.text


def test_a_checkpoint_of_another_shape_names_the_tensor(tmp_path):
    save_state_dict(torch.nn.Linear(3, 4).state_dict(), tmp_path)
    with pytest.raises(
        CheckpointError, match=r"tensor 'weight': the checkpoint has shape \[4, 3\], the destination \[5, 3\]"
    ):
        load_checkpoint_in_model(torch.nn.Linear(3, 5), tmp_path)


def test_a_shard_named_in_the_index_but_missing(tmp_path):
    save_state_dict(tiny_gpt2().state_dict(), tmp_path, max_shard_size="20KB")
    os.remove(tmp_path / f"model-00002-of-{len(list(tmp_path.glob('model-*'))):05d}.safetensors")
    with pytest.raises(CheckpointError, match="names shards that do not exist: .*model-00002-of"):
        load_checkpoint_in_model(tiny_gpt2(), tmp_path)


def test_a_folder_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        load_checkpoint_in_model(torch.nn.Linear(2, 2), tmp_path)


def test_the_progress_bar_shows_above_the_threshold_and_can_be_turned_off(tmp_path, monkeypatch, capsys):
    from accel.checkpoint import progress

    model = torch.nn.Linear(64, 64)
    monkeypatch.setattr(progress, "PROGRESS_THRESHOLD", 1000)  # this model's 16 KiB count as large
    save_state_dict(model.state_dict(), tmp_path / "a")
    assert "saving" in capsys.readouterr().err
    monkeypatch.setenv("ACCEL_DISABLE_PROGRESS", "1")
    save_state_dict(model.state_dict(), tmp_path / "b")
    load_checkpoint_in_model(model, tmp_path / "b")
    assert capsys.readouterr().err == ""
    load_checkpoint_in_model(model, tmp_path / "b", progress=True)  # the argument wins
    assert "loading" in capsys.readouterr().err


def test_switching_formats_removes_the_other_formats_files(tmp_path):
    model = torch.nn.Linear(4, 4)
    save_state_dict(model.state_dict(), tmp_path, max_shard_size=40)
    save_state_dict(model.state_dict(), tmp_path, safe_serialization=False)
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]


def test_temporary_files_of_a_killed_save_are_removed_by_the_next(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".model.safetensors.tmp-{dead.stdout.strip()}-abcd1234abcd1234"
    live = tmp_path / f".model.safetensors.tmp-{os.getpid()}-abcd1234abcd1234"  # a save in progress: kept
    link = tmp_path / f".pytorch_model.bin.tmp-{dead.stdout.strip()}-abcd1234abcd1234"  # not a file accel writes
    orphan.write_bytes(b"partial")
    live.write_bytes(b"partial")
    link.symlink_to(tmp_path / "model.safetensors")
    save_state_dict(torch.nn.Linear(2, 2).state_dict(), tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, link.name, "model.safetensors"])


def bits(model) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict on the CPU, as bytes (bit-exact comparisons)."""
    return {name: t.detach().cpu().reshape(-1).view(torch.uint8) for name, t in model.state_dict().items()}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [{}, {"durable": True}, {"async_save": True}], ids=["default", "durable", "async"])
def test_a_gpu_model_saves_and_loads_back_on_the_gpu_bit_for_bit(tmp_path, mode):
    """save_model of a model on the GPU in each save mode (durable: the native writer streams GPU memory through
    its pinned buffers; async: the pinned snapshot), into files transformers reads; then load_checkpoint_in_model
    into a GPU model (the native reader's pipeline, straight into GPU memory) and load_checkpoint_and_dispatch
    onto the GPU: the same bits. The embedding (30 MiB) spans several of the pipeline's 8 MiB chunks."""
    from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=30011, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval().cuda()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.bias.copy_(torch.randn(3 * 256) * 1e-40)  # subnormals survive too
    accelerator = Accelerator()
    assert accelerator.device.type == "cuda"
    accelerator.save_model(model, tmp_path / "ckpt", max_shard_size="20MB", **mode)
    accelerator.wait_for_checkpoint()
    assert len([f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors")]) >= 2
    model.config.save_pretrained(tmp_path / "ckpt")
    from_transformers = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt").eval()
    expected = bits(model)
    assert all(torch.equal(t, expected[n]) for n, t in bits(from_transformers).items())

    torch.manual_seed(1)
    target = transformers.GPT2LMHeadModel(config).eval().cuda()
    load_checkpoint_in_model(target, tmp_path / "ckpt", strict=True)
    assert all(torch.equal(t, expected[n]) for n, t in bits(target).items())
    assert target.lm_head.weight is target.transformer.wte.weight  # still tied

    with init_empty_weights():
        dispatched = transformers.GPT2LMHeadModel(config)
    dispatched = load_checkpoint_and_dispatch(dispatched, tmp_path / "ckpt", device_map={"": 0}).eval()
    assert all(t.is_cuda for t in dispatched.state_dict().values())
    assert all(torch.equal(t, expected[n]) for n, t in bits(dispatched).items())
    tokens = torch.arange(12, device="cuda").reshape(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(dispatched(tokens).logits, model(tokens).logits)
