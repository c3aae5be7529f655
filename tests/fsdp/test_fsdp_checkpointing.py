"""HF Accelerate's FSDP checkpointing test (its test_utils/scripts/external_deps/test_checkpointing.py, which
tests/fsdp/test_fsdp.py launches for each FSDP2 state dict type) on 2 CPU processes: a tiny local BERT classifier
on synthetic data instead of bert-base-cased on GLUE MRPC. One epoch is trained and saved, then a fresh run resumes
from the checkpoint: the same accuracy, learning rates and epoch, and (beyond HF's script) the next epoch's losses
equal an uninterrupted run's."""

import os

import pytest
import torch
from spawn_pool import run_on_ranks
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel.accelerator_config import DataLoaderConfiguration
from accel.backends.fsdp import FullyShardedDataParallelPlugin
from accel.state import AcceleratorState, GradientState

transformers = pytest.importorskip("transformers")

EPOCHS = 2


def data(train):
    """Token sequences whose label is whether their first token is even (learnable within a few steps)."""
    generator = torch.Generator().manual_seed(0 if train else 1)
    tokens = torch.randint(0, 64, (48 if train else 20, 8), generator=generator)
    return TensorDataset(tokens, (tokens[:, 0] % 2 == 0).long())


def fresh_run(state_dict_type, seed):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        state_dict_type=state_dict_type,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["BertLayer"],
    )
    # A seedable sampler, so that an epoch's order does not depend on the epochs before it in this process.
    accelerator = Accelerator(fsdp_plugin=plugin, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(seed)  # the model's initial weights: a resumed run's are overwritten by the checkpoint
    config = transformers.BertConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_loader = DataLoader(data(train=True), batch_size=8, shuffle=True)
    eval_loader = DataLoader(data(train=False), batch_size=8)
    steps = 2 * len(train_loader) * EPOCHS  # the prepared scheduler steps once per process at each step: lr > 0
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=steps)
    torch.manual_seed(42)  # the shuffling seed, as HF's script's set_seed
    return accelerator, *accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler)


def train_epoch(accelerator, model, optimizer, loader, scheduler):
    model.train()
    losses = []
    for tokens, labels in loader:
        loss = model(input_ids=tokens, labels=labels).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def evaluate(accelerator, model, loader):
    """(accuracy over the whole evaluation set, its summed logits: a finer check than the accuracy)."""
    model.eval()
    correct = total = 0
    logit_sum = 0.0
    with torch.no_grad():
        for tokens, labels in loader:
            logits = model(input_ids=tokens).logits
            logits, labels = accelerator.gather_for_metrics((logits, labels))
            correct += int((logits.argmax(-1) == labels).sum())
            total += len(labels)
            logit_sum += float(logits.sum())
    return correct / total, logit_sum


def _save_then_resume(folder, state_dict_type, async_save):
    accelerator, model, optimizer, train_loader, eval_loader, scheduler = fresh_run(state_dict_type, seed=0)
    train_epoch(accelerator, model, optimizer, train_loader, scheduler)
    accelerator.save_state(os.path.join(folder, "epoch_0"), async_save=async_save)
    saved = (evaluate(accelerator, model, eval_loader), scheduler.get_last_lr()[0], optimizer.param_groups[0]["lr"])
    straight = train_epoch(accelerator, model, optimizer, train_loader, scheduler)
    accelerator.wait_for_checkpoint()

    accelerator, model, optimizer, train_loader, eval_loader, scheduler = fresh_run(state_dict_type, seed=1)
    accelerator.load_state(os.path.join(folder, "epoch_0"))
    resumed_state = (
        evaluate(accelerator, model, eval_loader),
        scheduler.get_last_lr()[0],
        optimizer.param_groups[0]["lr"],
    )
    resumed = train_epoch(accelerator, model, optimizer, train_loader, scheduler)
    return saved, resumed_state, straight, resumed, sorted(os.listdir(os.path.join(folder, "epoch_0")))


@pytest.mark.parametrize(
    ("state_dict_type", "async_save", "layout"),
    [
        ("SHARDED_STATE_DICT", False, {"pytorch_model_fsdp_0", "optimizer_0"}),
        ("FULL_STATE_DICT", False, {"pytorch_model_fsdp.bin", "optimizer.bin"}),
        ("SHARDED_STATE_DICT", True, {"pytorch_model_fsdp_0", "optimizer_0"}),
        ("FULL_STATE_DICT", True, {"pytorch_model_fsdp.bin", "optimizer.bin"}),
    ],
)
def test_an_fsdp2_checkpoint_resumes_with_the_same_accuracy_learning_rates_and_losses(
    tmp_path, state_dict_type, async_save, layout
):
    for saved, resumed_state, straight, resumed, listing in run_on_ranks(
        _save_then_resume, 2, str(tmp_path), state_dict_type, async_save, timeout=180
    ):
        assert resumed_state == saved  # HF's checks: accuracy, the scheduler's and the optimizer's learning rates
        assert resumed == straight  # the next epoch as if never interrupted (data order, optimizer state, RNG)
        assert layout <= set(listing) and {"scheduler.bin", "sampler.bin", "random_states_1.pkl"} <= set(listing)


def _prepare_after_end_training():
    accelerator, *_ = fresh_run("SHARDED_STATE_DICT", seed=0)
    accelerator.end_training()
    try:
        fresh_run("SHARDED_STATE_DICT", seed=1)
    except RuntimeError as error:
        return str(error)
    return None


def test_preparing_an_fsdp_model_after_end_training_is_refused_instead_of_hanging():
    """HF's script resumes in a new process; resuming in the same one after end_training used to hang (fully_shard
    started a new default group of its own, whose rendezvous never completed)."""
    for message in run_on_ranks(_prepare_after_end_training, 2, timeout=60):
        assert message is not None and "was destroyed (end_training" in message
