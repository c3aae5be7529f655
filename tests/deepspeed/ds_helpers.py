"""What the DeepSpeed tests share: HF Accelerate's test configs (its tests/deepspeed/ds_config_*.json, as dicts),
the values its tests fill "auto" entries with, the one-process launcher environment its tests set, and tiny local
models in place of its Hub checkpoints (sshleifer/tiny-gpt2, gpt2, apple/mobilevit-xx-small)."""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

from accel.test_utils.training import RegressionDataset

# HF's `dist_env`: what `accelerate launch --use_deepspeed` exports to one process.
DIST_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "10999",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
}

# The values HF's tests hand `deepspeed_config_process` (fp16 -> bf16: DeepSpeed on CPU has no fp16).
FILL_KWARGS = {
    "fp16.enabled": False,
    "bf16.enabled": True,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 1,  # DeepSpeed 0.19.6 and later refuse 0 (HF's tests still pass 0)
    "train_micro_batch_size_per_gpu": 16,
    "gradient_clipping": 1.0,
    "train_batch_size": 16,
    "zero_optimization.reduce_bucket_size": 5e5,
    "zero_optimization.stage3_prefetch_bucket_size": 5e5,
    "zero_optimization.stage3_param_persistence_threshold": 5e5,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}

_PRECISION = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
}
_OPTIMIZER = {
    "type": "AdamW",
    "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True},
}
_SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
}
_BATCH = {
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
_CPU = {"device": "cpu", "pin_memory": True}


def zero2_config() -> dict:
    """HF's ds_config_zero2.json: ZeRO-2, optimizer state offloaded to the CPU, DeepSpeed's AdamW and WarmupLR."""
    zero = {
        "stage": 2,
        "offload_optimizer": dict(_CPU),
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    }
    return copy.deepcopy(
        {**_PRECISION, "optimizer": _OPTIMIZER, "scheduler": _SCHEDULER, "zero_optimization": zero, **_BATCH}
    )


def zero3_config() -> dict:
    """HF's ds_config_zero3.json, with `stage3_gather_16bit_weights_on_model_save` False as its tests set it."""
    zero = {
        "stage": 3,
        "offload_optimizer": dict(_CPU),
        "offload_param": dict(_CPU),
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    return copy.deepcopy(
        {**_PRECISION, "optimizer": _OPTIMIZER, "scheduler": _SCHEDULER, "zero_optimization": zero, **_BATCH}
    )


def zero3_model_only_config() -> dict:
    """HF's ds_config_zero3_model_only.json: an inference engine (no optimizer), parameters offloaded."""
    zero = {
        "stage": 3,
        "offload_param": dict(_CPU),
        "overlap_comm": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1e9,
        "stage3_prefetch_bucket_size": 1e9,
        "stage3_param_persistence_threshold": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    return copy.deepcopy({**_PRECISION, "zero_optimization": zero, "train_micro_batch_size_per_gpu": 1})


def tiny_gpt2_config():
    """A GPT-2 config small enough to build in milliseconds (hidden size 32)."""
    import transformers  # (here: the plugin-only tests run without it)

    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)


def tiny_gpt2(causal_lm: bool = False) -> torch.nn.Module:
    """HF's `AutoModel` / `AutoModelForCausalLM` of a tiny GPT-2, built from its config (`from_config`: under ZeRO-3
    init it is built partitioned, as `from_pretrained` builds it)."""
    import transformers

    auto = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
    torch.manual_seed(0)
    return auto.from_config(tiny_gpt2_config())


def linear_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """HF's `get_scheduler("linear", ..., num_warmup_steps=0, num_training_steps=1000)`."""
    import transformers

    return transformers.get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=1000)


def regression_loaders(train_batch: int = 16, eval_batch: int = 32) -> tuple[DataLoader, DataLoader]:
    """HF's train (80 samples, shuffled) and eval (20 samples) RegressionDataset loaders."""
    train = DataLoader(RegressionDataset(length=80, seed=0), batch_size=train_batch, shuffle=True)
    return train, DataLoader(RegressionDataset(length=20, seed=1), batch_size=eval_batch, shuffle=False)


def token_batch(batch_size: int, length: int = 8, seed: int = 0) -> torch.Tensor:
    """Token ids for the tiny GPT-2."""
    return torch.randint(0, 64, (batch_size, length), generator=torch.Generator().manual_seed(seed))
