"""A tiny transformers model trains through Accelerator.prepare; accel.utils understands its containers."""

import pytest
import torch
from spawn_pool import run_on_ranks

transformers = pytest.importorskip("transformers")

from accel.accelerator import Accelerator  # noqa: E402
from accel.utils import recursively_apply, send_to_device  # noqa: E402


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _train_gpt2(steps):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (16, 12), generator=generator)
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in tokens], batch_size=2)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(steps):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    head = accelerator.unwrap_model(model).lm_head.weight.detach().clone()
    return losses[0], losses[-1], head


@pytest.mark.slow
def test_tiny_gpt2_trains_on_two_processes():
    (first, last, head), (first_1, last_1, head_1) = run_on_ranks(_train_gpt2, 2, 3, timeout=180)
    assert last < first  # it learns
    assert (first, last) == (first_1, last_1)  # reduced losses agree on every rank
    assert torch.equal(head, head_1)  # DDP kept the replicas identical


def test_helpers_keep_batch_encoding_and_model_output_types():
    encoding = transformers.BatchEncoding(
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}
    )
    moved = send_to_device(encoding, "meta")
    assert isinstance(moved, transformers.BatchEncoding) and moved["input_ids"].device.type == "meta"
    output = tiny_gpt2()(input_ids=torch.zeros(1, 4, dtype=torch.long))
    doubled = recursively_apply(lambda t: t * 2, output, test_type=lambda t: isinstance(t, torch.Tensor))
    assert type(doubled) is type(output) and torch.equal(doubled.logits, output.logits * 2)
