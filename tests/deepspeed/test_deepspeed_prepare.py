"""HF Accelerate's one-process DeepSpeed `prepare` tests (its tests/deepspeed/test_deepspeed.py: test_prepare_deepspeed,
test_dataloader_with_batch_sampler, test_save_checkpoints, test_autofill_dsconfig, test_autofill_comm_buffers_dsconfig,
test_ds_zero3_no_init_autofill, test_prepare_deepspeed_prepare_moe; its test_deepspeed_gradient_accumulation.py) on
DeepSpeed's real engine in a CPU process, bf16 where HF runs fp16. Tiny GPT-2 / Qwen2-MoE models built from configs
stand for its Hub checkpoints. Beyond HF's cases: bf16 training, a run without any launcher variable, HF's refusals
(device placement, two models), and save_state / load_state in HF's folder layout.
"""

import importlib.util
import os

import pytest
import torch
from ds_helpers import (
    FILL_KWARGS,
    linear_schedule,
    regression_loaders,
    tiny_gpt2,
    tiny_gpt2_config,
    token_batch,
    zero2_config,
    zero3_config,
)
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from accel.backends.deepspeed import DeepSpeedPlugin, DummyOptim, DummyScheduler
from accel.scheduler import AcceleratedScheduler
from accel.state import AcceleratorState
from accel.test_utils.training import RegressionDataset
from accel.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper

if importlib.util.find_spec("deepspeed") is None:  # not imported here: accel imports it for the device it runs on
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)


def engine_class() -> type:
    """DeepSpeed's engine class (imported once accel has imported DeepSpeed for the device it runs on)."""
    import deepspeed

    return deepspeed.DeepSpeedEngine


transformers = pytest.importorskip("transformers")

# HF's plugin for a torch optimizer and scheduler: ZeRO-2, everything offloaded to the CPU, no ZeRO-3 init.
OFFLOADED_ZERO2 = dict(
    gradient_accumulation_steps=1,
    gradient_clipping=1.0,
    zero_stage=2,
    offload_optimizer_device="cpu",
    offload_param_device="cpu",
    zero3_save_16bit_model=False,
    zero3_init_flag=False,
)
NO_DATALOADER = (
    "When using DeepSpeed, `accelerate.prepare()` requires you to pass at least one of training or "
    "evaluation dataloaders with `batch_size` attribute returning an integer value or alternatively set "
    "an integer value in `train_micro_batch_size_per_gpu` in the deepspeed config file or assign integer "
    "value to `AcceleratorState().deepspeed_plugin.deepspeed_config['train_micro_batch_size_per_gpu']`."
)
NO_SCHEDULER_CALLABLE = (
    "Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` "
    "parameter when using `accelerate.utils.DummyScheduler`."
)


def filled(plugin: DeepSpeedPlugin, num_processes: int = 1) -> None:
    """What HF's tests do before prepare: fill the config's "auto" values with FILL_KWARGS."""
    train_batch = FILL_KWARGS["train_micro_batch_size_per_gpu"] * plugin.deepspeed_config["gradient_accumulation_steps"]
    plugin.deepspeed_config_process(**{**FILL_KWARGS, "train_batch_size": train_batch * num_processes})


def assert_engine_parts(accelerator, model, optimizer, scheduler, scheduler_type) -> None:
    assert type(model) is engine_class()
    assert type(optimizer) is DeepSpeedOptimizerWrapper
    assert type(scheduler) is scheduler_type
    assert type(accelerator.deepspeed_engine_wrapped) is DeepSpeedEngineWrapper
    assert accelerator.deepspeed_engine_wrapped.engine is model


# --- HF's test_prepare_deepspeed: the four optimizer / scheduler sources ------------------------------------------


def test_prepare_deepspeed_custom_optimizer_custom_scheduler(dist_env, new_accelerator):
    """HF's test_prepare_deepspeed (custom_optimizer, custom_scheduler): Dummy stand-ins without a config section
    and a prepare without dataloaders are refused; torch's optimizer and scheduler run inside the engine."""
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(**OFFLOADED_ZERO2))
    train, evaluation = regression_loaders()
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    scheduler = linear_schedule(optimizer)
    dummy_optimizer = DummyOptim(params=model.parameters())

    with pytest.raises(
        ValueError, match="You cannot create a `DummyOptim` without specifying an optimizer in the config file."
    ):
        accelerator.prepare(model, dummy_optimizer, train, evaluation, scheduler)
    with pytest.raises(ValueError) as raised:
        accelerator.prepare(model, optimizer, train, evaluation, DummyScheduler(dummy_optimizer))
    assert NO_SCHEDULER_CALLABLE in str(raised.value)
    with pytest.raises(ValueError) as raised:
        accelerator.prepare(model, optimizer, scheduler)
    assert NO_DATALOADER in str(raised.value)

    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)
    assert accelerator.deepspeed_config["zero_allow_untested_optimizer"]
    assert accelerator.deepspeed_config["train_batch_size"] == 16  # min(16, 32): is_train_batch_min
    assert_engine_parts(accelerator, model, optimizer, scheduler, AcceleratedScheduler)


def test_prepare_deepspeed_deepspeed_optimizer_deepspeed_scheduler(dist_env, new_accelerator):
    """HF's test_prepare_deepspeed (deepspeed_optimizer, deepspeed_scheduler): with both in the config, torch's
    optimizer or scheduler in the code is refused; Dummy stand-ins give the engine's own."""
    plugin = DeepSpeedPlugin(hf_ds_config=zero2_config())
    accelerator = new_accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    train, evaluation = regression_loaders(10, 5)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    scheduler = linear_schedule(optimizer)
    dummy_optimizer = DummyOptim(params=model.parameters())
    dummy_scheduler = DummyScheduler(dummy_optimizer)
    filled(accelerator.state.deepspeed_plugin)

    with pytest.raises(
        ValueError, match="You cannot specify an optimizer in the config file and in the code at the same time"
    ):
        accelerator.prepare(model, optimizer, train, evaluation, dummy_scheduler)
    with pytest.raises(
        ValueError, match="You cannot specify a scheduler in the config file and in the code at the same time"
    ):
        accelerator.prepare(model, dummy_optimizer, train, evaluation, scheduler)

    model, optimizer, train, evaluation, scheduler = accelerator.prepare(
        model, dummy_optimizer, train, evaluation, dummy_scheduler
    )
    assert_engine_parts(accelerator, model, optimizer, scheduler, DeepSpeedSchedulerWrapper)
    assert type(scheduler.scheduler).__name__ == "WarmupLR" and scheduler.scheduler is model.lr_scheduler


def test_prepare_deepspeed_custom_optimizer_deepspeed_scheduler(dist_env, new_accelerator):
    """HF's test_prepare_deepspeed (custom_optimizer, deepspeed_scheduler): torch's optimizer, the config's
    scheduler driving it inside the engine."""
    accelerator = new_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=zero2_config()), mixed_precision="bf16")
    train, evaluation = regression_loaders(10, 5)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    dummy_scheduler = DummyScheduler(DummyOptim(params=model.parameters()))
    filled(accelerator.state.deepspeed_plugin)
    del accelerator.state.deepspeed_plugin.deepspeed_config["optimizer"]

    model, optimizer, train, evaluation, scheduler = accelerator.prepare(
        model, optimizer, train, evaluation, dummy_scheduler
    )
    assert_engine_parts(accelerator, model, optimizer, scheduler, DeepSpeedSchedulerWrapper)


def test_prepare_deepspeed_deepspeed_optimizer_custom_scheduler(dist_env, new_accelerator):
    """HF's test_prepare_deepspeed (deepspeed_optimizer, custom_scheduler): with DummyOptim the scheduler must be a
    DummyScheduler, and one without a config section needs `lr_scheduler_callable`, which then builds it."""
    accelerator = new_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=zero2_config()), mixed_precision="bf16")
    train, evaluation = regression_loaders(10, 5)
    model = tiny_gpt2()
    scheduler = linear_schedule(torch.optim.AdamW(model.parameters(), lr=5e-5))
    dummy_optimizer = DummyOptim(params=model.parameters())
    filled(accelerator.state.deepspeed_plugin)
    del accelerator.state.deepspeed_plugin.deepspeed_config["scheduler"]

    with pytest.raises(
        ValueError,
        match=r"You can only specify `accelerate.utils.DummyScheduler` in the code when "
        r"using `accelerate.utils.DummyOptim`.",
    ):
        accelerator.prepare(model, dummy_optimizer, train, evaluation, scheduler)
    with pytest.raises(ValueError) as raised:
        accelerator.prepare(model, dummy_optimizer, train, evaluation, DummyScheduler(dummy_optimizer))
    assert NO_SCHEDULER_CALLABLE in str(raised.value)

    built = []

    def build_schedule(optimizer):
        built.append(linear_schedule(optimizer))
        return built[-1]

    dummy_scheduler = DummyScheduler(dummy_optimizer, lr_scheduler_callable=build_schedule)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(
        model, dummy_optimizer, train, evaluation, dummy_scheduler
    )
    assert_engine_parts(accelerator, model, optimizer, scheduler, DeepSpeedSchedulerWrapper)
    assert len(built) == 1 and scheduler.scheduler is built[0] and built[0].optimizer is model.basic_optimizer


# --- HF's other refusals -------------------------------------------------------------------------------------------


def test_dataloader_with_batch_sampler(dist_env, new_accelerator):
    """HF's test_dataloader_with_batch_sampler: a dataloader whose batch size is None (a batch sampler) cannot fill
    the "auto" micro batch size."""
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(**OFFLOADED_ZERO2))
    train_set, eval_set = RegressionDataset(length=80), RegressionDataset(length=20)
    train = DataLoader(train_set, batch_sampler=BatchSampler(RandomSampler(train_set), batch_size=10, drop_last=False))
    evaluation = DataLoader(
        eval_set, batch_sampler=BatchSampler(SequentialSampler(eval_set), batch_size=10, drop_last=False)
    )
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    with pytest.raises(ValueError) as raised:
        accelerator.prepare(model, optimizer, train, evaluation, linear_schedule(optimizer))
    assert (
        "At least one of the dataloaders passed to `accelerate.prepare()` has `None` as batch size. Please set an "
        "integer value in `train_micro_batch_size_per_gpu` in the deepspeed config file or assign integer value to "
        "`AcceleratorState().deepspeed_plugin.deepspeed_config['train_micro_batch_size_per_gpu']`."
    ) in str(raised.value)


def test_device_placement_and_two_models_are_refused(dist_env, new_accelerator):
    """HF's prepare under DeepSpeed: no custom device placement, one model per Accelerator."""
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    train, _ = regression_loaders()
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    with pytest.raises(ValueError, match="You can't customize device placements with DeepSpeed or Megatron-LM."):
        accelerator.prepare(model, optimizer, train, device_placement=[True, True, True])
    with pytest.raises(
        AssertionError,
        match=r"You can't use same `Accelerator\(\)` instance with multiple models "
        r"when using DeepSpeed",
    ):
        accelerator.prepare(model, tiny_gpt2(), optimizer, train)
    assert accelerator.deepspeed_engine_wrapped is None  # nothing was built


def test_prepare_without_dataloader_uses_the_configs_micro_batch_size(dist_env, new_accelerator):
    """A set `train_micro_batch_size_per_gpu` needs no dataloader (HF's prepare of a model alone)."""
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    model = tiny_gpt2()
    engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(engine) is engine_class() and engine.train_micro_batch_size_per_gpu() == 4
    assert accelerator.deepspeed_config["train_batch_size"] == 4 and engine.train_batch_size() == 4


def test_is_train_batch_min_false_takes_the_largest_batch(dist_env, new_accelerator):
    """HF's rule: with `is_train_batch_min=False` the micro batch size is the largest dataloader batch size."""
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2, is_train_batch_min=False)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    train, evaluation = regression_loaders(16, 32)
    model = tiny_gpt2()
    accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), train, evaluation)
    assert accelerator.deepspeed_config["train_micro_batch_size_per_gpu"] == 32
    assert accelerator.deepspeed_config["train_batch_size"] == 32 * 2


# --- HF's auto-filling tests ---------------------------------------------------------------------------------------


def test_autofill_dsconfig(dist_env, new_accelerator):
    """HF's test_autofill_dsconfig: every "auto" of the ZeRO-3 config is filled at prepare, from the dataloaders
    (micro and global batch), DummyOptim (lr, weight decay), DummyScheduler (warm-up), the model's hidden size
    (bucket sizes), and HF's defaults (clipping 1.0, no 16-bit gathering)."""
    plugin = DeepSpeedPlugin(hf_ds_config=zero3_config(), zero3_init_flag=True)
    del plugin.deepspeed_config["bf16"]
    del plugin.deepspeed_config["fp16"]
    accelerator = new_accelerator(deepspeed_plugin=plugin)
    train, evaluation = regression_loaders()
    model = tiny_gpt2(causal_lm=True)  # built partitioned (ZeRO-3 init), as HF's from_pretrained("gpt2")
    assert hasattr(next(model.parameters()), "ds_id")
    dummy_optimizer = DummyOptim(params=model.parameters(), lr=5e-5, weight_decay=1e-4)
    dummy_scheduler = DummyScheduler(dummy_optimizer, warmup_num_steps=10, total_num_steps=1000)
    hidden = model.config.hidden_size
    accelerator.prepare(model, dummy_optimizer, train, evaluation, dummy_scheduler)
    config = accelerator.deepspeed_config
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["train_batch_size"] == 16
    assert config["optimizer"]["params"]["lr"] == 5e-05 and config["optimizer"]["params"]["weight_decay"] == 1e-4
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-05, "warmup_num_steps": 10}
    assert config["gradient_clipping"] == 1.0
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert zero["stage3_prefetch_bucket_size"] == int((0.9 * hidden) * hidden)
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden
    assert not zero["stage3_gather_16bit_weights_on_model_save"]


def test_autofill_gradient_accumulation_steps_from_the_accelerator(dist_env, new_accelerator):
    """HF's test_autofill_dsconfig_from_ds_plugin, last part: "auto" accumulation steps take the Accelerator's."""
    config = zero3_config()
    del config["fp16"]
    config["gradient_accumulation_steps"] = "auto"
    plugin = DeepSpeedPlugin(
        hf_ds_config=config,
        zero3_init_flag=True,
        gradient_clipping=1.0,
        zero_stage=2,
        offload_optimizer_device="cpu",
        offload_param_device="cpu",
        zero3_save_16bit_model=True,
    )
    accelerator = new_accelerator(deepspeed_plugin=plugin, mixed_precision="bf16", gradient_accumulation_steps=8)
    train, evaluation = regression_loaders()
    model = tiny_gpt2(causal_lm=True)
    dummy_optimizer = DummyOptim(params=model.parameters(), lr=5e-5, weight_decay=1e-4)
    dummy_scheduler = DummyScheduler(dummy_optimizer, warmup_num_steps=10, total_num_steps=1000)
    model, *_ = accelerator.prepare(model, dummy_optimizer, train, evaluation, dummy_scheduler)
    assert accelerator.state.deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"] == 8
    assert accelerator.deepspeed_config["train_batch_size"] == 16 * 8
    assert model.gradient_accumulation_steps() == accelerator.gradient_accumulation_steps == 8


class ConfigWithoutHiddenSize:
    """HF's DummyConfig: a model config naming neither `hidden_size` nor `hidden_sizes`."""

    def __init__(self):
        self._name_or_path = "dummy"


@pytest.mark.parametrize(
    "model_type", ["no_config", "config_with_no_hidden_size", "config_with_hidden_size", "config_with_hidden_sizes"]
)
def test_autofill_comm_buffers_dsconfig(dist_env, new_accelerator, model_type):
    """HF's test_autofill_comm_buffers_dsconfig: the hidden-size based "auto" bucket keys need `model.config` with
    `hidden_size` or `hidden_sizes` (the largest); without them prepare names what is missing. (DeepSpeed 0.19.8's
    engine views every parameter as bytes to broadcast it, which fails for HF's RegressionModel's 0-dim ones, on any
    device: a Linear stands for it.)"""
    plugin = DeepSpeedPlugin(hf_ds_config=zero3_config(), zero3_init_flag=True)
    for section in ("bf16", "fp16", "optimizer", "scheduler"):
        del plugin.deepspeed_config[section]
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    train, evaluation = regression_loaders()
    model = torch.nn.Linear(1, 1)  # HF's RegressionModel has 0-dim parameters, which DeepSpeed 0.19.8 cannot broadcast
    hidden = None
    if model_type == "config_with_no_hidden_size":
        model.config = ConfigWithoutHiddenSize()
    elif model_type == "config_with_hidden_size":
        model.config = tiny_gpt2_config()
        hidden = model.config.hidden_size
    elif model_type == "config_with_hidden_sizes":
        model.config = transformers.MobileViTConfig()  # apple/mobilevit-xx-small's kind of config, built locally
        hidden = max(model.config.hidden_sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    objects = (model, optimizer, train, evaluation, linear_schedule(optimizer))

    errors = {
        "no_config": "Can't find `model.config` entry",
        "config_with_no_hidden_size": "Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`",
    }
    if model_type in errors:
        with pytest.raises(ValueError, match=errors[model_type]):
            accelerator.prepare(*objects)
        return
    accelerator.prepare(*objects)
    zero = accelerator.deepspeed_config["zero_optimization"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert zero["stage3_prefetch_bucket_size"] == int((0.9 * hidden) * hidden)
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden


def test_ds_zero3_no_init_autofill(dist_env, new_accelerator):
    """HF's test_ds_zero3_no_init_autofill: with ZeRO-3 init off, transformers still gets the ZeRO-3 config (HF hands
    it over whatever the flag), with the batch-size "auto" values it cannot take replaced, so a model builds
    (partitioned, under DeepSpeed's zero.Init) before prepare has filled anything."""
    config = {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 1,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000000,
        "zero_optimization": {
            "stage": 3,
            "allgather_partitions": True,
            "allgather_bucket_size": 5e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": False,
            "offload_optimizer": {"device": "none"},
            "offload_param": {"device": "none"},
        },
    }
    new_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False))
    from transformers.integrations import deepspeed_config

    handed = deepspeed_config()
    assert handed["train_micro_batch_size_per_gpu"] == 1 and "train_batch_size" not in handed
    model = tiny_gpt2(causal_lm=True)
    assert all(hasattr(parameter, "ds_id") for parameter in model.parameters())


def test_prepare_deepspeed_prepare_moe(dist_env, new_accelerator):
    """HF's test_prepare_deepspeed_prepare_moe: the classes `transformer_moe_cls_names` names become ZeRO-3 leaf
    modules at prepare (a tiny local Qwen2-MoE for HF's Hub one). DeepSpeed 0.19.8 makes Qwen2MoeSparseMoeBlock a
    leaf by itself, so a class it does not know (the attention) is named too: only the plugin makes that a leaf."""
    plugin = DeepSpeedPlugin(
        zero3_init_flag=True,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
        zero_stage=3,
        offload_optimizer_device="none",
        offload_param_device="none",
        zero3_save_16bit_model=True,
        transformer_moe_cls_names="Qwen2MoeSparseMoeBlock,Qwen2MoeAttention",
    )
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    config = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = accelerator.prepare(transformers.AutoModelForCausalLM.from_config(config))
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    for leaf_class in (modeling_qwen2_moe.Qwen2MoeSparseMoeBlock, modeling_qwen2_moe.Qwen2MoeAttention):
        leaves = [module for module in model.modules() if isinstance(module, leaf_class)]
        assert len(leaves) == 2 and all(getattr(module, "_z3_leaf", False) for module in leaves), leaf_class


# --- HF's test_save_checkpoints: the ZeRO-3 state dict rule --------------------------------------------------------


def test_save_checkpoints(dist_env, new_accelerator):
    """HF's test_save_checkpoints: under ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`, get_state_dict
    refuses, saying how to get the weights."""
    plugin = DeepSpeedPlugin(hf_ds_config=zero3_config(), zero3_init_flag=True)
    del plugin.deepspeed_config["fp16"]
    accelerator = new_accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    filled(accelerator.state.deepspeed_plugin, accelerator.num_processes)
    train, evaluation = regression_loaders()
    model = tiny_gpt2(causal_lm=True)
    dummy_optimizer = DummyOptim(params=model.parameters())
    model, *_ = accelerator.prepare(model, dummy_optimizer, train, evaluation, DummyScheduler(dummy_optimizer))
    with pytest.raises(ValueError) as raised:
        accelerator.get_state_dict(model)
    # HF's message, with accel's `accel config` for `accelerate config` (and `accel merge-weights` beside
    # zero_to_fp32.py, after the part asserted).
    message = str(raised.value)
    assert (
        "Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` in DeepSpeed config is "
        "False. To save the model weights in 16bit, set `stage3_gather_16bit_weights_on_model_save` to True in "
        "DeepSpeed config file or set `zero3_save_16bit_model` to True when using `accel config`. To save the full "
        "checkpoint, run `model.save_checkpoint(save_dir)` and use `zero_to_fp32.py`"
    ) in message


@pytest.mark.parametrize("stage", [2, 3])
def test_get_state_dict_gives_the_full_weights(dist_env, new_accelerator, stage):
    """HF's get_state_dict rule: stages 0-2 the module's state dict; ZeRO-3 with 16-bit gathering, the gathered
    weights (bf16: the engine's dtype), equal to the module's own."""
    original = tiny_gpt2()  # built before the Accelerator hands transformers the ZeRO-3 config: whole
    plugin = DeepSpeedPlugin(zero_stage=stage, zero3_save_16bit_model=True, zero3_init_flag=False)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    train, _ = regression_loaders()
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in original.state_dict().items()}
    model, _, _ = accelerator.prepare(original, torch.optim.AdamW(original.parameters(), lr=1e-3), train)
    state = accelerator.get_state_dict(model)
    assert set(state) >= {name for name, _ in original.named_parameters()}
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name


# --- Training on the engine ----------------------------------------------------------------------------------------


def train_steps(accelerator, model, optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        tokens = token_batch(4, seed=step % 2)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_trains(dist_env, new_accelerator, stage):
    """bf16 trains on the CPU: the engine holds bf16 weights, and the loss on two repeated batches falls."""
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    model = tiny_gpt2(causal_lm=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert model.bfloat16_enabled() and next(model.module.parameters()).dtype == torch.bfloat16
    losses = train_steps(accelerator, model, optimizer, 12)
    assert losses[-1] < 0.8 * losses[0], losses
    assert model.global_steps == 12


@pytest.mark.parametrize("stage", [2, 3])
def test_one_process_trains_without_launcher_variables(new_accelerator, stage):
    """A script run as `python train.py` (no launcher: no LOCAL_RANK, RANK, WORLD_SIZE): the Accelerator starts a
    process group of one, and DeepSpeed's engine builds and steps in it. DeepSpeed reads LOCAL_RANK (its engine
    asserts it; ZeRO-3 at every forward), so accel sets it as a launcher would."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert name not in os.environ, f"{name} is set: this test needs a process without launcher variables"
    model = tiny_gpt2(causal_lm=True)  # before the Accelerator: not under ZeRO-3 init
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    assert os.environ["LOCAL_RANK"] == "0"
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    train_steps(accelerator, model, optimizer, 2)
    assert model.global_steps == 2


# --- HF's test_deepspeed_gradient_accumulation.py ------------------------------------------------------------------


def accumulating(new_accelerator, steps: int):
    plugin = DeepSpeedPlugin(
        gradient_accumulation_steps=steps,
        **{k: v for k, v in OFFLOADED_ZERO2.items() if k != "gradient_accumulation_steps"},
    )
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    model = tiny_gpt2()
    train = DataLoader(RegressionDataset(length=16), batch_size=8)
    model, optimizer, train = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), train)
    return accelerator, model, optimizer


def test_gradient_accumulation_boundary_integration(dist_env, new_accelerator):
    """HF's test_gradient_accumulation_boundary_integration: under `accumulate`, sync_gradients is True on every
    4th micro step only, and (beyond HF) the engine's weights change only then."""
    accelerator, model, optimizer = accumulating(new_accelerator, 4)
    model.train()
    sync, changed = [], []
    for micro_step in range(8):
        with accelerator.accumulate(model):
            sync.append(accelerator.sync_gradients)
            before = next(model.module.parameters()).detach().clone()
            loss = model(input_ids=token_batch(8, seed=micro_step)).last_hidden_state.float().pow(2).mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                optimizer.step()
                optimizer.zero_grad()
            changed.append(not torch.equal(before, next(model.module.parameters())))
    assert sync == [False, False, False, True] * 2
    assert changed == sync and model.global_steps == 2


def test_clip_grad_norm_returns_deepspeed_grad_norm(dist_env, new_accelerator):
    """HF's test_clip_grad_norm_returns_deepspeed_grad_norm: after a step, clip_grad_norm_ returns the norm the
    engine measured (a float >= 0)."""
    accelerator, model, _ = accumulating(new_accelerator, 1)
    loss = model(input_ids=token_batch(8)).last_hidden_state.float().mean()
    accelerator.backward(loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert isinstance(norm, float) and norm > 0.0


def test_accelerator_backward_passes_sync_gradients(dist_env, new_accelerator):
    """HF's test_accelerator_backward_passes_sync_gradients: two micro steps of two, syncing on the second (the
    engine is at its accumulation boundary then, and steps)."""
    accelerator, model, _ = accumulating(new_accelerator, 2)
    sync, boundary = [], []
    for _ in range(2):
        with accelerator.accumulate(model):
            sync.append(accelerator.sync_gradients)
            accelerator.backward(model(input_ids=token_batch(8)).last_hidden_state.float().mean())
            boundary.append(model.is_gradient_accumulation_boundary())
    assert sync == [False, True] and boundary == [False, True] and model.global_steps == 1


# --- save_state / load_state ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["default", "async"])
def test_save_state_writes_hfs_layout_and_load_state_restores_it(dist_env, new_accelerator, tmp_path, async_save):
    """save_state writes the engine's checkpoint as HF does (`pytorch_model/` and DeepSpeed's `latest` naming it,
    zero_to_fp32.py, a scheduler the engine does not drive in scheduler.bin); load_state into a fresh engine
    restores weights, optimizer state and scheduler, so the next steps' losses equal an uninterrupted run's. An
    asynchronous save writes the engine's checkpoint at the call (it has no copy to hand over), the rest after."""

    def run(seed):
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
        accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return accelerator, *accelerator.prepare(model, optimizer, scheduler)

    def steps(accelerator, model, optimizer, scheduler, count):
        losses = []
        for step in range(count):
            tokens = token_batch(4, seed=step)
            accelerator.backward(loss := model(input_ids=tokens, labels=tokens).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    accelerator, model, optimizer, scheduler = run(seed=0)
    steps(accelerator, model, optimizer, scheduler, 3)
    accelerator.save_state(str(tmp_path / "ckpt"), async_save=async_save)
    straight = steps(accelerator, model, optimizer, scheduler, 3)
    accelerator.wait_for_checkpoint()
    listing = set(os.listdir(tmp_path / "ckpt"))
    assert {"pytorch_model", "latest", "zero_to_fp32.py", "scheduler.bin", "random_states_0.pkl"} <= listing, listing
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "pytorch_model"
    assert any(name.endswith("optim_states.pt") for name in os.listdir(tmp_path / "ckpt" / "pytorch_model"))
    accelerator.free_memory()
    accelerator.end_training()
    AcceleratorState._reset_state(True)
    accelerator, model, optimizer, scheduler = run(seed=1)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert scheduler.get_last_lr() == [1e-2 * 0.5]  # three steps of StepLR(2, 0.5)
    assert model.global_steps == 3
    resumed = steps(accelerator, model, optimizer, scheduler, 3)
    assert resumed == straight


def test_load_state_names_a_missing_engine_checkpoint(dist_env, new_accelerator, tmp_path):
    """load_state from a folder without `pytorch_model/` fails naming it, and changes nothing."""
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    model = tiny_gpt2()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="pytorch_model"):
        accelerator.load_state(str(tmp_path / "empty"))
    assert all(torch.equal(before[name], tensor) for name, tensor in model.module.state_dict().items())


def test_a_new_accelerator_after_end_training_builds_an_engine(dist_env, new_accelerator):
    """end_training destroys the process group (through torch); an Accelerator made afterwards in the same process
    (a notebook, a sweep) starts a new one, and DeepSpeed must not build its next engine on groups of the old."""
    for run in range(2):
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
        accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
        model = tiny_gpt2(causal_lm=True)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        train_steps(accelerator, model, optimizer, 1)
        assert model.global_steps == 1
        accelerator.free_memory()
        accelerator.end_training()
        AcceleratorState._reset_state(True)
