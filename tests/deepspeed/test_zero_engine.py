"""DeepSpeed's engine through `Accelerator` on 2 CPU processes (issue 22): ZeRO 1, 2 and 3 train as DDP does, a
resumed run continues bit-identically, the optimizer state is partitioned, the engine's checkpoint is HF's layout
and converts with DeepSpeed's zero_to_fp32, and a process killed mid-save leaves the previous checkpoint whole."""

import importlib.util
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.accelerator import Accelerator
from accel.backends.deepspeed import DeepSpeedPlugin
from accel.state import AcceleratorState, GradientState

if importlib.util.find_spec("deepspeed") is None:  # not imported here: accel imports it for the device it runs on
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")


def fresh_accelerator(stage=None, **kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = None if stage is None else DeepSpeedPlugin(zero_stage=stage, zero3_save_16bit_model=True)
    return Accelerator(deepspeed_plugin=plugin, **kwargs)


def tiny_gpt2(seed=0):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def loader(seed=0, batches=20):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 97, (2 * 2 * batches, 16), generator=generator)  # 2 per batch, 2 processes
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, torch.arange(len(tokens))), batch_size=2)


def prepared(accelerator, seed=0, data_seed=0, batches=20):
    model = tiny_gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return accelerator.prepare(model, optimizer, loader(data_seed, batches))


def train(accelerator, model, optimizer, data):
    losses, norms, seen = [], [], []
    for tokens, rows in data:
        with accelerator.accumulate(model):
            loss = model(tokens, labels=tokens).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        seen += rows.tolist()
    return losses, norms, seen


def _each_stage_and_ddp():
    results = {}
    for stage in (None, 1, 2, 3):
        accelerator = fresh_accelerator(stage, gradient_accumulation_steps=2)
        model, optimizer, data = prepared(accelerator)
        losses, norms, seen = train(accelerator, model, optimizer, data)
        held = 0  # fp32 optimizer state elements this process holds
        inner = optimizer.optimizer
        for state in inner.state.values():
            held += sum(t.numel() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        weights = {name: t.float().clone() for name, t in (accelerator.get_state_dict(model) or {}).items()}
        results[stage] = (str(accelerator.distributed_type), losses, norms, seen, held, weights)
    return results


def test_zero_1_2_and_3_train_as_ddp_does_with_the_optimizer_state_partitioned():
    """20 steps of a tiny GPT-2 (accumulating 2, clipped at 1.0): each ZeRO stage gives DDP's losses and gradient
    norms to fp32 rounding; each process saw its own batches (as under DDP); each holds about half of the Adam
    state; the full weights come back on the main process (ZeRO-3: 16-bit gather, here fp32)."""
    results = run_on_ranks(_each_stage_and_ddp, 2, timeout=300)
    assert not set(results[0][2][3]) & set(results[1][2][3])  # each process saw its own batches (ZeRO-2 here)
    for rank, result in enumerate(results):
        ddp_type, ddp_losses, ddp_norms, ddp_seen, ddp_held, ddp_weights = result[None]
        assert ddp_type == "DistributedType.MULTI_CPU"
        for stage in (1, 2, 3):
            kind, losses, norms, seen, held, weights = result[stage]
            assert kind == "DistributedType.DEEPSPEED"
            torch.testing.assert_close(losses, ddp_losses, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(norms, ddp_norms, rtol=1e-5, atol=1e-6)
            assert seen == ddp_seen
            assert held <= ddp_held // 2 + 4096, (stage, held, ddp_held)
            if rank == 0 or stage != 3:
                assert weights.keys() <= ddp_weights.keys()
                for name, tensor in weights.items():
                    torch.testing.assert_close(tensor, ddp_weights[name], rtol=1e-4, atol=1e-5)


def _save_train_load_train(folder, stage):
    accelerator = fresh_accelerator(stage)
    model, optimizer, data = prepared(accelerator, batches=3)
    train(accelerator, model, optimizer, data)
    accelerator.save_state(folder)
    straight = train(accelerator, model, optimizer, accelerator.prepare(loader(seed=2, batches=3)))[0]
    accelerator = fresh_accelerator(stage)
    model, optimizer, _ = prepared(accelerator, seed=7, batches=3)
    accelerator.load_state(folder)
    resumed = train(accelerator, model, optimizer, accelerator.prepare(loader(seed=2, batches=3)))[0]
    return straight, resumed, sorted(os.listdir(folder)), sorted(os.listdir(os.path.join(folder, "pytorch_model")))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_has_hf_layout_and_resumes_bit_identically(tmp_path, stage):
    folder = str(tmp_path / "state")
    for straight, resumed, listing, engine_files in run_on_ranks(_save_train_load_train, 2, folder, stage, timeout=240):
        assert straight == resumed
        assert {"latest", "pytorch_model", "zero_to_fp32.py", "random_states_0.pkl", "random_states_1.pkl"} <= set(
            listing
        )
        assert "model.safetensors" not in listing and "optimizer.bin" not in listing  # inside the engine's folder
        assert sum(name.endswith("optim_states.pt") for name in engine_files) == 2  # one partition per process
    with open(os.path.join(folder, "latest")) as f:
        assert f.read().strip() == "pytorch_model"
    _converts_with_zero_to_fp32_and_merge_weights(folder, tmp_path)


def _converts_with_zero_to_fp32_and_merge_weights(folder, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    weights = get_fp32_state_dict_from_zero_checkpoint(folder)
    expected = tiny_gpt2().state_dict()
    assert {name for name in expected if not name.endswith(".attn.bias")} <= set(weights)
    assert all(weights[name].dtype == torch.float32 and weights[name].shape == expected[name].shape for name in weights)
    for source, out in ((folder, "merged"), (os.path.join(folder, "pytorch_model"), "merged_tag")):
        subprocess.run(
            [sys.executable, "-m", "accel", "merge-weights", source, str(tmp_path / out)], check=True, timeout=120
        )
        merged = load_file(str(tmp_path / out / "model.safetensors"))
        assert merged.keys() == weights.keys()
        assert all(torch.equal(merged[name], weights[name]) for name in weights)


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from accel.accelerator import Accelerator
    from accel.backends.deepspeed import DeepSpeedPlugin
    folder = sys.argv[1]
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model = torch.nn.Linear(512, 1024)
    optimizer = torch.optim.Adam(model.parameters())
    loader = torch.utils.data.DataLoader(torch.zeros(4, 512), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    iteration = 0
    while True:
        with torch.no_grad():
            model.module.weight.fill_(iteration)
        accelerator.save_state(folder)
        iteration += 1
        if iteration == 1:
            print("ready", flush=True)
    """
)


def test_a_process_killed_mid_save_leaves_the_previous_engine_checkpoint_whole(tmp_path):
    """One process (a group of one) saving in a loop, killed at a random moment, five times: the folder always holds
    one whole checkpoint (every weight from the same save), which loads."""
    script = tmp_path / "saver.py"
    script.write_text(CRASH_SCRIPT)
    generator = random.Random(0)
    for run in range(5):
        folder = tmp_path / f"run{run}" / "state"
        child = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(generator.uniform(0.0, 0.5))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        accelerator = fresh_accelerator(2)
        model = torch.nn.Linear(512, 1024)
        model, _, _ = accelerator.prepare(
            model, torch.optim.Adam(model.parameters()), torch.utils.data.DataLoader(torch.zeros(4, 512), batch_size=2)
        )
        accelerator.load_state(str(folder))
        weight = model.module.weight
        assert torch.all(weight == weight[0, 0])  # one consistent save, never a mix
        accelerator.end_training()
