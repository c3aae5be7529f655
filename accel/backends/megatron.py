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
    "tp_degree": (int, 1),
    "pp_degree": (int, 1),
    "use_custom_fsdp": (bool, False),
    "no_load_optim": (bool, False),
    "eod_mask_loss": (bool, False),
    "no_save_optim": (bool, False),
    "optimizer_cpu_offload": (bool, False),
    "overlap_cpu_optimizer_d2h_h2d": (bool, False),
    "use_precision_aware_optimizer": (bool, False),
    "decoder_last_pipeline_num_layers": (_optional_int, None),
    "num_micro_batches": (int, 1),
    "gradient_clipping": (float, 1.0),
    "recompute_activations": (bool, False),
    "use_distributed_optimizer": (bool, False),
    "sequence_parallelism": (bool, False),
    "recompute_granularity": (str, "full"),
    "recompute_method": (str, "uniform"),
    "recompute_num_layers": (int, 1),
    "attention_backend": (bool, True),
    "expert_model_parallel_size": (int, 1),
    "context_parallel_size": (int, 2),
    "attention_dropout": (float, 0.0),
    "hidden_dropout": (float, 0.0),
    "attention_softmax_in_fp32": (bool, True),
    "expert_tensor_parallel_size": (int, 1),
    "calculate_per_token_loss": (bool, True),
    "use_rotary_position_embeddings": (bool, True),
}
# megatron_lm_default_args key -> plugin field (where the names differ).
_ARG_NAMES = {
    "tensor_model_parallel_size": "tp_degree",
    "pipeline_model_parallel_size": "pp_degree",
    "sequence_parallel": "sequence_parallelism",
    "clip_grad": "gradient_clipping",
}
_ARGS_AS_IS = [
    "pipeline_model_parallel_split_rank",
    "num_layers_per_virtual_pipeline_stage",
    "DDP_impl",
    "use_distributed_optimizer",
    "num_micro_batches",
    "consumed_samples",
    "no_wd_decay_cond",
    "scale_lr_cond",
    "lr_mult",
    "megatron_dataset_flag",
    "eval_iters",
    "eval_interval",
    *[
        f
        for f in _FROM_ENV
        if f
        not in (
            "tp_degree",
            "pp_degree",
            "gradient_clipping",
            "recompute_activations",
            "sequence_parallelism",
            "use_distributed_optimizer",
            "num_micro_batches",
        )
    ],
]

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
        raise ValueError(
            f"No Megatron-LM config parser for {model_type} models; register one with "
            "add_model_config_to_megatron_parser."
        )

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
        self.megatron_lm_default_args.update(
            data_parallel_size=dp_degree, micro_batch_size=micro_batch_size, global_batch_size=self.global_batch_size
        )

    def set_optimizer_type(self, optimizer: Any) -> None:
        """Records an Adam- or SGD-family optimizer's hyperparameters as Megatron arguments."""
        name, defaults, args = type(optimizer).__name__.lower(), optimizer.defaults, self.megatron_lm_default_args
        if "adam" in name:
            args.update(
                optimizer="adam",
                adam_beta1=defaults["betas"][0],
                adam_beta2=defaults["betas"][1],
                adam_eps=defaults["eps"],
            )
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
                warnings.warn(
                    "Ignoring `train_samples` as `train_iters` based on scheduler is being used for training."
                )
        if self.lr_warmup_iters is None:
            self.lr_warmup_iters = scheduler.warmup_num_steps // data_parallel
            if self.lr_warmup_samples is not None:
                warnings.warn(
                    "Ignoring `lr_warmup_samples` as `lr_warmup_iters` based on scheduler is being used for training."
                )
            self.lr_warmup_samples = 0
        for name in (
            "train_iters",
            "lr_warmup_iters",
            "train_samples",
            "lr_warmup_samples",
            "lr_decay_iters",
            "lr_decay_samples",
            "lr_warmup_fraction",
            "lr_decay_style",
            "weight_decay_incr_style",
            "start_weight_decay",
            "end_weight_decay",
            "min_lr",
        ):
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


# --- HF's model-config parsers: a transformers model's sizes as Megatron-LM arguments (no Megatron-LM needed) ----


def _input_length(batch_data: Any, key: str, default: int) -> int:
    return default if batch_data is None else batch_data[key].shape[1]


def _one_stack_length(plugin: MegatronLMPlugin, own: str, batch_data: Any, max_positions: int) -> int:
    """BERT / GPT-2: `own` (encoder/decoder_seq_length) when set, else `seq_length`, else the batch's, else the
    maximum positions. (HF replaces a given `seq_length` with `own` even when `own` is None.)"""
    own_length = getattr(plugin, own)
    if own_length is not None:
        if plugin.seq_length is not None:
            warnings.warn(f"Both `seq_length` and `{own}` are set. Using `{own}`.")
        return own_length
    return plugin.seq_length if plugin.seq_length is not None else _input_length(batch_data, "input_ids", max_positions)


def _decoder_length(plugin: MegatronLMPlugin, model: Any, batch_data: Any) -> int:
    """Llama-like models: `seq_length`, else the config's max_sequence_length, else decoder_seq_length, else the
    batch's, else the maximum positions."""
    for length in (plugin.seq_length, getattr(model.config, "max_sequence_length", None), plugin.decoder_seq_length):
        if length is not None:
            return length
    return _input_length(batch_data, "input_ids", model.config.max_position_embeddings)


def _set_network_args(plugin: MegatronLMPlugin, model: Any, **args: Any) -> None:
    plugin.megatron_lm_default_args.update(args, model_return_dict=model.config.return_dict)


@add_model_config_to_megatron_parser("megatron-bert")
def parse_bert_config(megatron_lm_plugin: MegatronLMPlugin, model: Any, batch_data: Any) -> None:
    """Sets BERT's sizes (and pretraining for a masked-LM head) in `megatron_lm_plugin.megatron_lm_default_args`."""
    config, plugin = model.config, megatron_lm_plugin
    plugin.seq_length = _one_stack_length(plugin, "encoder_seq_length", batch_data, config.max_position_embeddings)
    _set_network_args(
        plugin,
        model,
        seq_length=plugin.seq_length,
        model_type_name="bert",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        pretraining_flag="maskedlm" in type(model).__name__.lower(),
        orig_vocab_size=config.vocab_size,
        num_labels=config.num_labels,
    )


@add_model_config_to_megatron_parser("gpt2")
def parse_gpt2_config(megatron_lm_plugin: MegatronLMPlugin, model: Any, batch_data: Any) -> None:
    """Sets GPT-2's sizes and tokenizer in `megatron_lm_plugin.megatron_lm_default_args`."""
    config, plugin = model.config, megatron_lm_plugin
    plugin.seq_length = _one_stack_length(plugin, "decoder_seq_length", batch_data, config.n_positions)
    _set_network_args(
        plugin,
        model,
        seq_length=plugin.seq_length,
        return_logits=plugin.return_logits,
        tokenizer_type="GPT2BPETokenizer",
        model_type_name="gpt",
        num_layers=config.n_layer,
        hidden_size=config.n_embd,
        num_attention_heads=config.n_head,
        max_position_embeddings=config.n_positions,
        pretraining_flag=True,
        orig_vocab_size=config.vocab_size,
    )


@add_model_config_to_megatron_parser("t5")
def parse_t5_config(megatron_lm_plugin: MegatronLMPlugin, model: Any, batch_data: Any) -> None:
    """Sets T5's sizes and encoder/decoder lengths in `megatron_lm_plugin.megatron_lm_default_args`."""
    config, plugin = model.config, megatron_lm_plugin
    max_positions = getattr(config, "n_positions", 1024)
    if plugin.encoder_seq_length is None:
        plugin.encoder_seq_length = _input_length(batch_data, "input_ids", max_positions)
    if plugin.decoder_seq_length is None:
        plugin.decoder_seq_length = _input_length(batch_data, "labels", max_positions)
    _set_network_args(
        plugin,
        model,
        encoder_seq_length=plugin.encoder_seq_length,
        decoder_seq_length=plugin.decoder_seq_length,
        model_type_name="t5",
        num_layers=config.num_layers,
        hidden_size=config.d_model,
        num_attention_heads=config.num_heads,
        max_position_embeddings=max_positions,
        pretraining_flag=True,
        orig_vocab_size=config.vocab_size,
    )


def _decoder_args(plugin: MegatronLMPlugin, model: Any, batch_data: Any, tokenizer: str, pretraining: bool) -> None:
    config = model.config
    plugin.seq_length = _decoder_length(plugin, model, batch_data)
    _set_network_args(
        plugin,
        model,
        return_logits=plugin.return_logits,
        tokenizer_type=tokenizer,
        model_type_name="gpt",
        num_layers=config.num_hidden_layers,
        pretraining_flag=pretraining,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        orig_vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        seq_length=plugin.seq_length,
    )


@add_model_config_to_megatron_parser("llama")
def parse_llama_config(megatron_lm_plugin: MegatronLMPlugin, model: Any, batch_data: Any) -> None:
    """Sets Llama's sizes and tokenizer in `megatron_lm_plugin.megatron_lm_default_args`."""
    _decoder_args(megatron_lm_plugin, model, batch_data, "Llama2Tokenizer", pretraining=True)


@add_model_config_to_megatron_parser("glm4_moe")
def parse_glm4_moe_config(megatron_lm_plugin: MegatronLMPlugin, model: Any, batch_data: Any) -> None:
    """Sets GLM-4 MoE's sizes, attention, experts and precision in `megatron_lm_plugin.megatron_lm_default_args`."""
    config, args = model.config, megatron_lm_plugin.megatron_lm_default_args
    _decoder_args(megatron_lm_plugin, model, batch_data, "HuggingFaceTokenizer", pretraining=False)
    dense_layers = config.first_k_dense_replace
    args.update(
        {
            "kv_channels": config.head_dim,
            "position_embedding_type": "rope",
            "original_model_type": config.model_type,
            "qk_layernorm": config.use_qk_norm,
            "add_bias_linear": False,
            "group_query_attention": True,
            "num_query_groups": config.num_key_value_heads,
            "ffn_hidden_size": config.intermediate_size,
            "add_qkv_bias": True,
            "normalization": "RMSNorm",
            "rotary-percent": 0.5,
            "swiglu": True,
            "moe_ffn_hidden_size": config.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": config.moe_intermediate_size,
            "moe_router_pre_softmax": True,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0,
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_token_dispatcher_type": "alltoall",
            "moe_router_topk": config.num_experts_per_tok,
            "moe_router_topk_scaling_factor": config.routed_scaling_factor,
            "moe_layer_freq": [0] * dense_layers + [1] * (config.num_hidden_layers - dense_layers),
            "num_experts": config.n_routed_experts,
            "moe_grouped_gemm": True,
            "moe_router_dtype": "fp32",
            "moe_permute_fusion": True,
            "moe_aux_loss_coeff": 0,
            "rotary_base": config.rope_theta,
            "rope_type": "rope",
            "rotary_percent": config.partial_rotary_factor,
            "norm_epsilon": 1e-3,
            "use_flash_attn": True,
            "eos_token_id": config.eos_token_id,
            "bf16": config.bf16,
            "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
        }
    )
    if getattr(config, "fp8_param", False):
        args.update({name: getattr(config, name) for name in ("fp8", "fp8_param", "fp8_param_gather", "fp8_recipe")})


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
    "AbstractTrainStep",
    "BertTrainStep",
    "GPTTrainStep",
    "MODEL_CONFIGS_TO_MEGATRON_PARSERS",
    "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler",
    "MegatronLMPlugin",
    "T5TrainStep",
    "add_model_config_to_megatron_parser",
    "avg_losses_across_data_parallel_group",
    "parse_bert_config",
    "parse_glm4_moe_config",
    "parse_gpt2_config",
    "parse_llama_config",
    "parse_t5_config",
]
