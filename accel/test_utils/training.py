"""The toy regression task HF Accelerate's own test scripts train (`y = a*x + b` plus noise), and the MRPC
dataloaders its example tests use in place of downloading GLUE."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from accel.state import DistributedType


class RegressionDataset:
    """`length` samples {"x": x, "y": a*x + b + noise} (float32, noise sd 0.1), reproducible with `seed`."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """`x * a + b` with two scalar parameters; prints the dtypes on the first batch (HF's scripts read it)."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        return x * self.a + self.b


def _mrpc() -> Any:
    from datasets import load_dataset

    data_files = {"train": "tests/test_samples/MRPC/train.csv", "validation": "tests/test_samples/MRPC/dev.csv"}
    return load_dataset("csv", data_files=data_files)


def _tokenized(datasets: Any, tokenize: Any, accelerator: Any) -> Any:
    with accelerator.main_process_first():  # the main process fills the datasets cache, the others read it
        return datasets.map(tokenize, batched=True, remove_columns=["sentence1", "sentence2", "label"])


def mocked_dataloaders(accelerator: Any, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    """MRPC dataloaders (train shuffled, batch 2; validation batch 1) read from `tests/test_samples/MRPC/*.csv` and
    tokenized with bert-base-cased, for the examples' tests (needs datasets and transformers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("bert-base-cased")
    datasets = _mrpc()
    label_to_id = {label: i for i, label in enumerate(datasets["train"].unique("label"))}

    def tokenize(examples: dict) -> dict:
        outputs = tokenizer(
            examples["sentence1"], examples["sentence2"], truncation=True, max_length=None, padding="max_length"
        )
        if "label" in examples:
            outputs["labels"] = [label_to_id[label] for label in examples["label"]]
        return outputs

    tokenized = _tokenized(datasets, tokenize, accelerator)

    def collate(examples: list) -> Any:
        if accelerator.distributed_type == DistributedType.XLA:
            return tokenizer.pad(examples, padding="max_length", max_length=128, return_tensors="pt")
        return tokenizer.pad(examples, padding="longest", return_tensors="pt")

    return (
        DataLoader(tokenized["train"], shuffle=True, collate_fn=collate, batch_size=2),
        DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate, batch_size=1),
    )


def mocked_dataloaders_for_autoregressive_models(
    accelerator: Any, batch_size: int = 16
) -> tuple[DataLoader, DataLoader]:
    """MRPC first sentences as causal-LM batches (labels = inputs shifted by one, padding as -100), tokenized with
    SmolLM-360M's tokenizer (needs datasets and transformers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM-360M")
    tokenizer.pad_token = tokenizer.eos_token

    def tokenize(examples: dict) -> dict:
        return tokenizer(examples["sentence1"], truncation=True, max_length=None, return_attention_mask=False)

    tokenized = _tokenized(_mrpc(), tokenize, accelerator)

    def collate(examples: list) -> Any:
        longest = (
            128 if accelerator.distributed_type == DistributedType.XLA else max(len(e["input_ids"]) for e in examples)
        )
        multiple = {"fp8": 16, "no": None}.get(accelerator.mixed_precision, 8)  # round shapes for mixed precision
        batch = tokenizer.pad(
            examples, padding="max_length", max_length=longest + 1, pad_to_multiple_of=multiple, return_tensors="pt"
        )
        batch["labels"] = torch.where(
            batch["input_ids"][:, 1:] == tokenizer.pad_token_id, -100, batch["input_ids"][:, 1:]
        )
        batch["input_ids"] = batch["input_ids"][:, :-1]
        if "attention_mask" in batch:
            batch["attention_mask"] = batch["attention_mask"][:, :-1]
        return batch

    return (
        DataLoader(tokenized["train"], shuffle=False, collate_fn=collate, batch_size=2),
        DataLoader(tokenized["validation"], shuffle=False, collate_fn=collate, batch_size=1),
    )
