"""`accel estimate-memory`: HF Accelerate's table for a model built from its config on the meta device."""

import pytest

from accel.cli.estimate import estimate_training_usage, render_table
from accel.cli.main import main
from accel.formatting import convert_bytes

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    config.save_pretrained(folder)
    return folder


def expected_sizes(folder):
    """Total bytes and the biggest of the model's top-level layers (a GPT2Block is not split), counted here."""
    import torch

    with torch.device("meta"):
        model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32)

    def size(module):
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    layers = [model.wte, model.wpe, *model.h, model.ln_f]
    return size(model), max(size(layer) for layer in layers)


def table_rows(output):
    rows = [line for line in output.splitlines() if line.startswith("│") and line.count("│") == 5]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.split("│")[1:-1]] for row in rows)}


def test_a_local_gpt2_folder_gives_hf_accelerates_table(tiny_gpt2, capsys):
    assert main(["estimate-memory", str(tiny_gpt2)]) == 0
    output = capsys.readouterr().out
    assert f"Loading pretrained config for `{tiny_gpt2}` from `transformers`..." in output
    assert f"Memory Usage for loading `{tiny_gpt2}`" in output
    total, largest = expected_sizes(tiny_gpt2)
    rows = table_rows(output)
    assert rows["dtype"] == ["Largest Layer", "Total Size", "Training using Adam"]
    assert rows["float32"] == [convert_bytes(largest), convert_bytes(total), convert_bytes(4 * total)]
    assert rows["float16"] == [convert_bytes(largest / 2), convert_bytes(total / 2), convert_bytes(2 * total)]
    assert rows["int8"] == [convert_bytes(largest / 4), convert_bytes(total / 4), "N/A"]
    assert rows["int4"] == [convert_bytes(largest / 8), convert_bytes(total / 8), "N/A"]


def test_chosen_dtypes_only(tiny_gpt2, capsys):
    assert (
        main(["estimate-memory", str(tiny_gpt2), "--dtypes", "int4", "float32", "--library_name", "transformers"]) == 0
    )
    assert list(table_rows(capsys.readouterr().out)) == ["dtype", "int4", "float32"]


def test_a_folder_without_config_is_a_clear_error(tmp_path, capsys):
    assert main(["estimate-memory", str(tmp_path)]) == 2
    assert f"accel estimate-memory: error: {tmp_path}: no config.json" in capsys.readouterr().err


def test_an_unreachable_hub_is_a_clear_error(monkeypatch, capsys):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "model_info", offline)
    assert main(["estimate-memory", "someone/some-model"]) == 2
    err = capsys.readouterr().err
    assert "cannot look up 'someone/some-model' on the Hugging Face Hub (ConnectionError: no network)" in err
    assert "local model folder" in err


def test_training_estimate_is_hf_accelerates():
    assert max(estimate_training_usage(1000, "float32").values()) == 4000
    assert max(estimate_training_usage(1000, "float16").values()) == 2000
    assert max(estimate_training_usage(1000, "int8").values()) == -1
    assert [convert_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 bytes", "1.5 KB", "3.0 GB"]


def test_the_table_widens_for_a_long_title():
    table = render_table(["a", "bb"], [["1", "2"], ["333", "4"]], "a title longer than the columns")
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[0].startswith("┌") and lines[-1].startswith("└")
    assert lines[1] == "│a title longer than the columns│"
    assert lines[3].startswith("│ a │") and lines[5].startswith("│ 1 │")
