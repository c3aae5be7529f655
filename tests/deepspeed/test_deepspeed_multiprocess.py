"""DeepSpeed on 2 CPU processes (the spawn pool's gloo group, as `accel launch --num_processes 2 --use_deepspeed`):
what one process cannot show. Dataloaders are sharded as under DDP and the "auto" batch values count both processes
(HF's _prepare_deepspeed); HF's checkpointing test (its DeepSpeedIntegrationTest.test_checkpointing, which resumes
test_checkpointing.py from epoch_0 under ZeRO-2 and ZeRO-3) as a save_state / load_state round trip on tiny GPT-2s:
every process writes its ZeRO partition into HF's layout, and a fresh run resumes as if never interrupted.
"""

import importlib.util
import os

import pytest
import torch
from ds_helpers import tiny_gpt2_config, token_batch, zero3_config
from spawn_pool import run_on_ranks
from torch.utils.data import DataLoader

from accel.accelerator import Accelerator
from accel.backends.deepspeed import DeepSpeedPlugin, DummyOptim, DummyScheduler
from accel.data.prepare import prepare_data_loader
from accel.state import AcceleratorState, GradientState

if importlib.util.find_spec("deepspeed") is None:  # not imported here: accel imports it for the device it runs on
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")


def tiny_causal_lm(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config())


def _sharding_and_batch_values():
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
    config = plugin.deepspeed_config
    config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    }
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    rank = accelerator.process_index
    dataset = list(range(16))
    model = tiny_causal_lm(seed=rank)  # different on each rank: the engine starts from rank 0's weights
    optimizer = DummyOptim(model.parameters(), lr=1e-2)
    scheduler = DummyScheduler(optimizer, total_num_steps=11, warmup_num_steps=2)
    engine, _, loader, _ = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=2), scheduler)
    under_ddp = prepare_data_loader(
        DataLoader(dataset, batch_size=2), num_processes=2, process_index=rank, put_on_device=False
    )
    seen = [batch.tolist() for batch in loader]
    for step, batch in enumerate(seen):
        tokens = token_batch(2, seed=100 * rank + step)
        with accelerator.accumulate(engine):
            accelerator.backward(engine(input_ids=tokens, labels=tokens).loss)
    weights = torch.cat([parameter.detach().float().flatten() for parameter in engine.module.parameters()])
    result = {
        "seen": seen,
        "ddp": [batch.tolist() for batch in under_ddp],
        "config": accelerator.deepspeed_config,
        "global_steps": engine.global_steps,
        "weights": weights,
    }
    accelerator.end_training()
    return result


def test_dataloaders_are_sharded_as_under_ddp_and_auto_values_count_both_processes():
    """Each process gets the batches DDP would give it (different ones, together the whole dataset); the "auto"
    global batch is micro x accumulation x 2 processes and the decay schedule's total steps are split over them
    (HF's rule); the engines start from rank 0's weights and stay equal through accumulated steps."""
    first, second = run_on_ranks(_sharding_and_batch_values, 2, timeout=240)
    for result in (first, second):
        assert result["seen"] == result["ddp"] and len(result["seen"]) == 4
        config = result["config"]
        assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 2
        assert config["train_batch_size"] == 2 * 2 * 2
        assert config["scheduler"]["params"]["total_num_steps"] == 6  # ceil(11 / 2)
        assert config["scheduler"]["params"]["warmup_num_steps"] == 2 and config["optimizer"]["params"]["lr"] == 1e-2
        assert result["global_steps"] == 2
    assert not set(map(tuple, first["seen"])) & set(map(tuple, second["seen"]))
    assert sorted(sum(first["seen"] + second["seen"], [])) == list(range(16))
    assert torch.equal(first["weights"], second["weights"])


# --- HF's test_checkpointing: save_state / load_state round trip ----------------------------------------------------


def _fresh_run(stage: int, seed: int):
    AcceleratorState._reset_state()  # the process group stays: a new Accelerator on it, as a resumed job's
    GradientState._reset_state()
    transformers.integrations.unset_hf_deepspeed_config()  # the last run's: a new job starts without it
    model = tiny_causal_lm(seed)  # built whole (before the Accelerator hands transformers a ZeRO-3 config)
    if stage == 2:  # torch's optimizer and scheduler (the scheduler in scheduler.bin)
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    else:  # HF's ZeRO-3 config: DeepSpeed's AdamW and WarmupLR (in the engine's checkpoint), offloaded to the CPU
        plugin = DeepSpeedPlugin(hf_ds_config=zero3_config())
        optimizer = DummyOptim(model.parameters(), lr=1e-2)
        scheduler = DummyScheduler(optimizer, warmup_num_steps=4)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    return accelerator, *accelerator.prepare(model, optimizer, scheduler)


def _train(accelerator, model, optimizer, scheduler, steps, first_step):
    losses = []
    for step in range(first_step, first_step + steps):
        tokens = token_batch(2, seed=10 * step + accelerator.process_index)  # a different batch on each rank
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, scheduler.get_last_lr()


def _save_then_resume(folder, stage):
    accelerator, model, optimizer, scheduler = _fresh_run(stage, seed=0)
    _train(accelerator, model, optimizer, scheduler, 3, first_step=0)
    accelerator.save_state(os.path.join(folder, "epoch_0"))
    straight = _train(accelerator, model, optimizer, scheduler, 3, first_step=3)
    accelerator.free_memory()

    accelerator, model, optimizer, scheduler = _fresh_run(stage, seed=1)
    accelerator.load_state(os.path.join(folder, "epoch_0"))
    steps_at_load = model.global_steps
    resumed = _train(accelerator, model, optimizer, scheduler, 3, first_step=3)
    accelerator.free_memory()
    accelerator.end_training()
    return straight, resumed, steps_at_load


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpointing_resumes_on_two_processes(tmp_path, stage):
    """HF's test_checkpointing under ZeRO-2 and ZeRO-3 on 2 processes: save_state writes the engine's checkpoint in
    HF's layout (`pytorch_model/` holding each process's optimizer partition, DeepSpeed's `latest` naming it), and a
    fresh run with other weights resumes from it with the same losses and learning rates as the uninterrupted run."""
    for straight, resumed, steps_at_load in run_on_ranks(_save_then_resume, 2, str(tmp_path), stage, timeout=120):
        assert steps_at_load == 3
        assert resumed == straight
    folder = tmp_path / "epoch_0"
    assert (folder / "latest").read_text().strip() == "pytorch_model"
    files = os.listdir(folder / "pytorch_model")
    for rank in (0, 1):
        assert any(
            name.startswith(f"bf16_zero_pp_rank_{rank}_") and name.endswith("optim_states.pt") for name in files
        ), files
    assert {"zero_to_fp32.py", "random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(folder))
    assert ("scheduler.bin" in os.listdir(folder)) == (stage == 2)  # ZeRO-3's WarmupLR is inside the engine's
