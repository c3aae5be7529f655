"""Megatron-LM's names (accel does not run Megatron-LM): the plugin builds its arguments; engines are refused.

`MegatronLMPlugin(...)` resolves its fields from MEGATRON_LM_* variables with HF Accelerate's defaults and builds
`megatron_lm_default_args` as HF does; `add_model_config_to_megatron_parser` registers model-config parsers.
The train steps, the dummy data loader and the loss averaging need Megatron-LM itself and are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from abc import ABC
from typing import Any, Callable

from accel.backends import DDP_INSTEAD, env_flag
from accel.unsupported import refuse

FEATURE = "Megatron-LM"


def _refuse(asked_by: str):
    return refuse(FEATURE, asked_by, DDP_INSTEAD)


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value is None else int(value)


# Fields read from MEGATRON_LM_<FIELD> when left None: field -> (how to read, default).
_FROM_ENV: dict[str, tuple[Callable, Any]] = {
    "tp_degree": (int, 1), "pp_degree": (int, 1), "use_custom_fsdp": (bool, False), "no_load_optim": (bool, False),
    "eod_mask_loss": (bool, False), "no_save_optim": (bool, False), "optimizer_cpu_offload": (bool, False),
    "overlap_cpu_optimizer_d2h_h2d": (bool, False), "use_precision_aware_optimizer": (bool, False),
    "decoder_last_pipeline_num_layers": (_optional_int, None), "num_micro_batches": (int, 1),
    "gradient_clipping": (float, 1.0), "recompute_activations": (bool, False),
    "use_distributed_optimizer": (bool, False), "sequence_parallelism": (bool, False),
    "recompute_granularity": (str, "full"), "recompute_method": (str, "uniform"), "recompute_num_layers": (int, 1),
    "attention_backend": (bool, True), "expert_model_parallel_size": (int, 1), "context_parallel_size": (int, 2),
    "attention_dropout": (float, 0.0), "hidden_dropout": (float, 0.0), "attention_softmax_in_fp32": (bool, True),
    "expert_tensor_parallel_size": (int, 1), "calculate_per_token_loss": (bool, True),
    "use_rotary_position_embeddings": (bool, True),
}  # fmt: skip
# megatron_lm_default_args key -> plugin field (where the names differ).
_ARG_NAMES = {"tensor_model_parallel_size": "tp_degree", "pipeline_model_parallel_size": "pp_degree",
              "sequence_parallel": "sequence_parallelism", "clip_grad": "gradient_clipping"}  # fmt: skip
_ARGS_AS_IS = [
    "pipeline_model_parallel_split_rank", "num_layers_per_virtual_pipeline_stage", "DDP_impl",
    "use_distributed_optimizer", "num_micro_batches", "consumed_samples", "no_wd_decay_cond", "scale_lr_cond",
    "lr_mult", "megatron_dataset_flag", "eval_iters", "eval_interval", *[f for f in _FROM_ENV if f not in (
        "tp_degree", "pp_degree", "gradient_clipping", "recompute_activations", "sequence_parallelism",
        "use_distributed_optimizer", "num_micro_batches")],
]  # fmt: skip

MODEL_CONFIGS_TO_MEGATRON_PARSERS: dict[str, Callable] = {}


def _read_env(field: str) -> Any:
    read, default = _FROM_ENV[field]
    name = "MEGATRON_LM_" + field.upper()
    if read is bool:
        return env_flag(name, default)
    if read is _optional_int:
        return _optional_int(name)
    return read(os.environ.get(name, default))


@dataclasses.dataclass
class MegatronLMPlugin:
    """HF Accelerate's Megatron-LM plugin (fields, MEGATRON_LM_* variables, defaults); accel refuses to run it."""

    tp_degree: int | None = None
    pp_degree: int | None = None
    use_custom_fsdp: bool | None = None
    overlap_cpu_optimizer_d2h_h2d: bool | None = None
    no_load_optim: bool | None = None
    eod_mask_loss: bool | None = None
    no_save_optim: bool | None = None
    optimizer_cpu_offload: bool | None = None
    use_precision_aware_optimizer: bool | None = None
    decoder_last_pipeline_num_layers: int | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_backend: bool | None = None
    expert_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    attention_dropout: float | None = None
    hidden_dropout: float | None = None
    attention_softmax_in_fp32: bool | None = None
    expert_tensor_parallel_size: int | None = None
    calculate_per_token_loss: bool | None = None
    use_rotary_position_embeddings: bool | None = None
    num_micro_batches: int | None = None
    gradient_clipping: float | None = None
    sequence_parallelism: bool | None = None
    recompute_activations: bool | None = None
    use_distributed_optimizer: bool | None = None
    pipeline_model_parallel_split_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    is_train_batch_min: bool = True
    train_iters: int | None = None
    train_samples: int | None = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_warmup_fraction: float | None = None
    min_lr: float = 0
    consumed_samples: list[int] | None = None
    no_wd_decay_cond: Callable | None = None
    scale_lr_cond: Callable | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    tensorboard_dir: str | None = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Any = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Callable | None = None
    custom_prepare_model_function: Callable | None = None
    custom_megatron_datasets_provider_function: Callable | None = None
    custom_get_batch_function: Callable | None = None
    custom_loss_function: Callable | None = None
    other_megatron_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for field in _FROM_ENV:
            if getattr(self, field) is None:
                setattr(self, field, _read_env(field))
        self.DDP_impl = "local" if self.pp_degree > 1 or self.use_distributed_optimizer else "torch"
        if self.consumed_samples is not None:  # one count per dataloader: train, eval, test
            self.consumed_samples.extend([0] * (3 - len(self.consumed_samples)))
        self.megatron_lm_default_args = {arg: getattr(self, field) for arg, field in _ARG_NAMES.items()}
        self.megatron_lm_default_args.update({name: getattr(self, name) for name in _ARGS_AS_IS})
        if self.tensorboard_dir is not None:
            self.megatron_lm_default_args["tensorboard_dir"] = self.tensorboard_dir
            if self.set_all_logging_options:
                self.set_tensorboard_logging_options()
        if self.other_megatron_args is not None:
            self.megatron_lm_default_args.update(self.other_megatron_args)

    def set_network_size_args(self, model: Any, batch_data: Any = None) -> None:
        """Fills the network size arguments with the parser registered for the model's config type."""
        model_type = model.config.model_type.lower()
        for name, parser in MODEL_CONFIGS_TO_MEGATRON_PARSERS.items():
            if name in model_type:
                parser(self, model, batch_data)
                return
        raise ValueError(f"No Megatron-LM config parser for {model_type} models; register one with "
                         "add_model_config_to_megatron_parser.")  # fmt: skip

    def set_mixed_precision(self, mixed_precision: str) -> None:
        if mixed_precision == "fp16":
            self.megatron_lm_default_args["fp16"] = True
        elif mixed_precision == "bf16":
            self.megatron_lm_default_args["bf16"] = True
            self.DDP_impl = self.megatron_lm_default_args["DDP_impl"] = "local"

    def set_training_args(self, micro_batch_size: int, dp_degree: int) -> None:
        self.data_parallel_size = dp_degree
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = dp_degree * micro_batch_size * self.num_micro_batches
        self.megatron_lm_default_args.update(data_parallel_size=dp_degree, micro_batch_size=micro_batch_size,
                                             global_batch_size=self.global_batch_size)  # fmt: skip

    def set_optimizer_type(self, optimizer: Any) -> None:
        """Records an Adam- or SGD-family optimizer's hyperparameters as Megatron arguments."""
        name, defaults, args = type(optimizer).__name__.lower(), optimizer.defaults, self.megatron_lm_default_args
        if "adam" in name:
            args.update(optimizer="adam", adam_beta1=defaults["betas"][0], adam_beta2=defaults["betas"][1],
                        adam_eps=defaults["eps"])  # fmt: skip
        elif "sgd" in name:
            args.update(optimizer="sgd", sgd_momentum=defaults["momentum"])
        else:
            raise ValueError(f"Optimizer {name} is not supported by Megatron-LM")
        args.update(lr=defaults["lr"], weight_decay=defaults["weight_decay"])

    def set_scheduler_args(self, scheduler: Any) -> None:
        """Records a `MegatronLMDummyScheduler`'s steps (per data-parallel rank) as Megatron arguments."""
        data_parallel = self.megatron_lm_default_args["data_parallel_size"]
        if self.train_iters is None:
            self.train_iters = scheduler.total_num_steps // data_parallel
            if self.train_samples is not None:
                self.train_samples = None
                warnings.warn("Ignoring `train_samples` as `train_iters` based on scheduler is being used for training.")
        if self.lr_warmup_iters is None:
            self.lr_warmup_iters = scheduler.warmup_num_steps // data_parallel
            if self.lr_warmup_samples is not None:
                warnings.warn("Ignoring `lr_warmup_samples` as `lr_warmup_iters` based on scheduler is being used for "
                              "training.")  # fmt: skip
            self.lr_warmup_samples = 0
        for name in ("train_iters", "lr_warmup_iters", "train_samples", "lr_warmup_samples", "lr_decay_iters",
                     "lr_decay_samples", "lr_warmup_fraction", "lr_decay_style", "weight_decay_incr_style",
                     "start_weight_decay", "end_weight_decay", "min_lr"):  # fmt: skip
            self.megatron_lm_default_args[name] = getattr(self, name)

    def set_tensorboard_logging_options(self) -> None:
        raise _refuse("MegatronLMPlugin(set_all_logging_options=True)")


def add_model_config_to_megatron_parser(model_type: str) -> Callable[[Callable], Callable]:
    """Decorator registering `parser(megatron_lm_plugin, model, batch_data)` for configs of `model_type`."""

    def register(parser: Callable) -> Callable:
        @functools.wraps(parser)
        def wrapper(*args, **kwargs):
            return parser(*args, **kwargs)

        MODEL_CONFIGS_TO_MEGATRON_PARSERS[model_type] = parser
        return wrapper

    return register


class AbstractTrainStep(ABC):
    """Base of a Megatron-LM train step: batching, forward step and loss functions."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def get_batch_func(self, accelerator: Any, megatron_dataset_flag: bool) -> Any:
        pass

    def get_forward_step_func(self) -> Any:
        pass

    def get_loss_func(self, accelerator: Any) -> Any:
        pass


class _MegatronTrainStep(AbstractTrainStep):
    def __init__(self, *args: Any, **kwargs: Any):
        raise _refuse(f"{type(self).__name__}(...)")


class BertTrainStep(_MegatronTrainStep):
    """Megatron-LM's BERT train step (needs Megatron-LM: refused)."""


class GPTTrainStep(_MegatronTrainStep):
    """Megatron-LM's GPT train step (needs Megatron-LM: refused)."""


class T5TrainStep(_MegatronTrainStep):
    """Megatron-LM's T5 train step (needs Megatron-LM: refused)."""


class MegatronLMDummyDataLoader:
    """Megatron-LM's indexed-dataset loader (parses Megatron's data arguments: refused)."""

    def __init__(self, **dataset_kwargs: Any):
        raise _refuse("MegatronLMDummyDataLoader(...)")


class MegatronLMDummyScheduler:
    """Stands for the scheduler Megatron-LM builds from the plugin's arguments.

    Args:
        optimizer: The optimizer.
        total_num_steps: Total number of steps.
        warmup_num_steps: Warmup steps.
        **kwargs: Other arguments.
    """

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0, **kwargs: Any):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.kwargs = kwargs


def avg_losses_across_data_parallel_group(losses: list) -> Any:
    """Megatron-LM's loss average over its data-parallel group (needs Megatron's groups: refused)."""
    raise _refuse("avg_losses_across_data_parallel_group(losses)")


__all__ = [
    "AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "MODEL_CONFIGS_TO_MEGATRON_PARSERS", "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler", "MegatronLMPlugin", "T5TrainStep", "add_model_config_to_megatron_parser",
    "avg_losses_across_data_parallel_group",
]  # fmt: skip
