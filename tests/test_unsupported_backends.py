"""Backends accel does not run: their configs build as HF Accelerate's do, using them is refused clearly.

Refusals name the feature, what asked for it and what accel runs instead, and come before any state is set up.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import accel
from accel import Accelerator
from accel.accelerator_config import CustomDtype
from accel.backends import deepspeed, fp8, fsdp, megatron, parallelism
from accel.backends.bnb import BnbQuantizationConfig, has_4bit_bnb_layers, load_and_quantize_model
from accel.state import AcceleratorState, PartialState
from accel.unsupported import UnsupportedFeatureError


def _refused(call, feature: str, asked_by: str) -> UnsupportedFeatureError:
    with pytest.raises(UnsupportedFeatureError) as caught:
        call()
    error = caught.value
    assert feature in error.feature and asked_by in error.asked_by, (error.feature, error.asked_by)
    assert error.instead and error.instead in str(error) and asked_by in str(error)
    return error


# --- Accelerator(...) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "feature", "asked_by"),
    [
        (lambda: {"megatron_lm_plugin": megatron.MegatronLMPlugin()}, "Megatron-LM", "megatron_lm_plugin="),
        (
            lambda: {"torch_tp_plugin": parallelism.TorchTensorParallelPlugin(tp_size=2)},
            "tensor parallelism",
            "torch_tp_plugin=",
        ),
        (
            lambda: {"parallelism_config": parallelism.ParallelismConfig(tp_size=2)},
            "tensor parallelism",
            "parallelism_config=...) with tp_size=2",
        ),
        (
            lambda: {"parallelism_config": parallelism.ParallelismConfig(dp_shard_size=2)},
            "sharded data parallelism",
            "dp_shard_size=2",
        ),  # without FSDP (with it: tests/test_fsdp2.py)
        (lambda: {"parallelism_config": parallelism.ParallelismConfig(cp_size=2)}, "context parallelism", "cp_size=2"),
        (lambda: {"mixed_precision": "fp8"}, "FP8 training", "mixed_precision='fp8'"),
        (lambda: {"kwargs_handlers": [fp8.TERecipeKwargs()]}, "FP8 training", "kwargs_handlers=[TERecipeKwargs"),
        (lambda: {"kwargs_handlers": [fp8.MSAMPRecipeKwargs()]}, "FP8 training", "[MSAMPRecipeKwargs"),
        (lambda: {"kwargs_handlers": [fp8.AORecipeKwargs()]}, "FP8 training", "[AORecipeKwargs"),
    ],
)
def test_accelerator_refuses_backends_before_any_state(kwargs, feature, asked_by):
    arguments = kwargs()
    _refused(lambda: Accelerator(**arguments), feature, asked_by)
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}


@pytest.mark.parametrize(
    ("variable", "value", "feature"),
    [
        ("ACCEL_USE_MEGATRON_LM", "yes", "Megatron-LM"),
        ("ACCEL_MIXED_PRECISION", "fp8", "FP8 training"),
        ("ACCELERATE_TORCH_DEVICE", "xla:0", "TPU/XLA"),
    ],
)
def test_launcher_variables_asking_for_backends_are_refused(monkeypatch, variable, value, feature):
    monkeypatch.setenv(variable, value)
    _refused(Accelerator, feature, f"the environment variable {variable}")
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}


def test_parallelism_config_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    _refused(Accelerator, "tensor parallelism", "ACCELERATE_USE_PARALLELISM_CONFIG with tp_size=2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    assert Accelerator().parallelism_config.total_size == 1


def test_a_data_parallel_config_is_plain_ddp_and_accepted():
    with pytest.warns(FutureWarning, match="TorchTensorParallelPlugin"):
        accelerator = Accelerator(torch_tp_plugin=parallelism.TorchTensorParallelPlugin(tp_size=1))
    assert accelerator.parallelism_config.tp_size == 1 and accelerator.torch_device_mesh is None
    assert accelerator.should_save_model
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match=r"total_size \(2\) does not match num_processes \(1\)"):
        Accelerator(parallelism_config=parallelism.ParallelismConfig(dp_replicate_size=2))


def test_placeholders_of_other_engines_are_refused_by_prepare():
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"DummyOptim\(\.\.\.\)\): it stands for the optimizer .* needs DeepSpeed"):
        accelerator.prepare(deepspeed.DummyOptim(model.parameters()))  # without DeepSpeed (with it: tests/deepspeed)
    _refused(
        lambda: accelerator.prepare(megatron.MegatronLMDummyScheduler(None)), "Megatron-LM", "MegatronLMDummyScheduler"
    )


def test_state_level_deepspeed_members_without_deepspeed_say_it_is_not_enabled():
    state = AcceleratorState(_from_accelerator=True)
    assert state.deepspeed_plugin is None and state.deepspeed_plugins is None and not state.is_fsdp2
    for call in (lambda: state.get_deepspeed_plugin("a"), lambda: state.select_deepspeed_plugin("a")):
        with pytest.raises(ValueError, match="DeepSpeed is not enabled"):
            call()
    with pytest.raises(ValueError, match="DeepSpeed is not enabled, cannot get active DeepSpeed plugin"):
        deepspeed.get_active_deepspeed_plugin(state)


# --- configurations build as in HF Accelerate ---------------------------------------------------------------


def test_deepspeed_plugin_reads_the_launcher_variables(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    plugin = deepspeed.DeepSpeedPlugin(gradient_clipping=1.0)
    config = plugin.deepspeed_config
    assert (plugin.zero_stage, plugin.gradient_accumulation_steps, plugin.zero3_init_flag) == (3, 4, True)
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "nvme_path": None}
    assert config["gradient_clipping"] == 1.0 and config["train_batch_size"] == "auto"
    assert plugin.hf_ds_config.is_zero3() and plugin.hf_ds_config.is_offload() and not plugin.selected


def test_deepspeed_config_sources_and_auto_values(tmp_path):
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    for source in (config, str(path), json.dumps(config), encoded):
        assert deepspeed.HfDeepSpeedConfig(source).get_value("zero_optimization.stage") == 2
    assert config == {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}  # not modified
    with pytest.raises(ValueError, match="Expected a string path to an existing deepspeed config"):
        deepspeed.HfDeepSpeedConfig("not json, not a file")
    plugin = deepspeed.DeepSpeedPlugin(hf_ds_config=config)
    assert plugin.zero_stage == 2 and plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    assert plugin.is_auto("train_micro_batch_size_per_gpu")
    plugin.deepspeed_config_process(train_micro_batch_size_per_gpu=8)
    assert plugin.get_value("train_micro_batch_size_per_gpu") == 8
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1 vs arg gradient_accumulation_steps=2"):
        plugin.deepspeed_config_process(gradient_accumulation_steps=2)
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"] == {"enabled": True} and plugin.deepspeed_config["fp16"] == {
        "enabled": False
    }
    with pytest.raises(ValueError, match="Please specify the ZeRO optimization config"):
        deepspeed.DeepSpeedPlugin(hf_ds_config={"train_batch_size": 8})
    with pytest.raises(ValueError, match="must be enabled manually"):
        plugin.select()  # only AcceleratorState selects (HF)


def test_fsdp_plugin_resolves_as_hf(monkeypatch):
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecisionPolicy, ShardingStrategy

    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    monkeypatch.setenv("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    plugin = fsdp.FullyShardedDataParallelPlugin()
    assert plugin.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert plugin.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
    assert plugin.cpu_offload == CPUOffload(offload_params=True) and plugin.use_orig_params is False
    version2 = fsdp.FullyShardedDataParallelPlugin(
        fsdp_version=2, sharding_strategy=None, mixed_precision_policy="bf16", auto_wrap_policy="size_based_wrap"
    )
    assert version2.reshard_after_forward is True and version2.min_num_params == 0
    assert isinstance(version2.mixed_precision_policy, MixedPrecisionPolicy)
    assert version2.mixed_precision_policy.param_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="Invalid auto wrap policy: everything"):
        fsdp.FullyShardedDataParallelPlugin(auto_wrap_policy="everything")


def test_megatron_plugin_and_model_parsers(monkeypatch):
    monkeypatch.setenv("MEGATRON_LM_TP_DEGREE", "2")
    monkeypatch.setenv("MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER", "true")
    plugin = megatron.MegatronLMPlugin(consumed_samples=[5], other_megatron_args={"seed": 3})
    args = plugin.megatron_lm_default_args
    assert args["tensor_model_parallel_size"] == 2 and args["DDP_impl"] == "local" and args["seed"] == 3
    assert plugin.consumed_samples == [5, 0, 0] and args["context_parallel_size"] == 2

    @megatron.add_model_config_to_megatron_parser("tiny-test")
    def parse(plugin, model, batch_data):
        plugin.megatron_lm_default_args["num_layers"] = model.config.layers

    monkeypatch.setitem(megatron.MODEL_CONFIGS_TO_MEGATRON_PARSERS, "tiny-test", parse.__wrapped__)
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="Tiny-Test", layers=4))
    plugin.set_network_size_args(model)
    assert args["num_layers"] == 4
    with pytest.raises(ValueError, match="No Megatron-LM config parser for other"):
        plugin.set_network_size_args(types.SimpleNamespace(config=types.SimpleNamespace(model_type="other")))


def test_fp8_recipes_read_the_environment_and_validate(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "e4m3")
    monkeypatch.setenv("ACCELERATE_FP8_OVERRIDE_DGRAD", "true")
    recipe = fp8.TERecipeKwargs()
    assert (recipe.fp8_format, recipe.amax_history_len, recipe.override_linear_precision) == (
        "E4M3",
        1024,
        (False, True, False),
    )
    with pytest.raises(ValueError, match="fp8_format"):
        fp8.TERecipeKwargs(fp8_format="E9")
    with pytest.raises(ValueError, match="opt_level"):
        fp8.MSAMPRecipeKwargs(opt_level="O3")
    with pytest.warns(FutureWarning, match="FP8RecipeKwargs is deprecated"):
        assert fp8.FP8RecipeKwargs(backend="te").backend == "TE"
    assert fp8.AORecipeKwargs().pad_inner_dim is True


def test_bnb_config_validates_as_hf():
    config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16")
    assert config.target_dtype is CustomDtype.INT4 and config.torch_dtype is torch.bfloat16
    assert BnbQuantizationConfig(load_in_8bit=True).torch_dtype is torch.float16
    with pytest.raises(ValueError, match="can't be both False"):
        BnbQuantizationConfig()
    with pytest.raises(ValueError, match="bnb_4bit_quant_type must be in"):
        BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="int3")


def test_parallelism_configs_validate():
    config = parallelism.ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert config.total_size == 4 and config.active_mesh_dims == ["dp_shard", "tp"]
    assert config._get_mesh() == (("dp_shard", "tp"), (2, 2)) and config.to_json()["tp_size"] == 2
    assert isinstance(config.tp_handler, parallelism.TorchTensorParallelConfig)
    with pytest.raises(ValueError, match="mutually exclusive"):
        parallelism.ParallelismConfig(cp_size=2, sp_size=2)
    with pytest.raises(ValueError, match="cp_comm_strategy"):
        parallelism.TorchContextParallelConfig(cp_comm_strategy="ring")
    with pytest.raises(ValueError, match="'eager' and 'flex_attention' are not supported"):
        parallelism.DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")


# --- helpers: real where they make sense without the engine, refused where they need it --------------------


def test_fsdp_environment_toggles(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "")  # recorded, so that monkeypatch removes what the toggle sets
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "unset")
    fsdp.enable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True" and os.environ["ACCELERATE_USE_FSDP"] == "True"
    fsdp.disable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"


class _Tied(torch.nn.Module):
    _tied_weights_keys = ["decoder.weight"]

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Embedding(4, 3)
        self.decoder = torch.nn.Linear(3, 4, bias=False)
        self.decoder.weight = self.encoder.weight


def test_ensure_weights_retied_keeps_ties_through_reinitialization():
    model = _Tied()

    def reinit(module):  # what an FSDP param_init_fn does: new parameter objects
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().clone()))
        return module

    retie = fsdp.ensure_weights_retied(reinit, model, torch.device("cpu"))
    for module in (model.encoder, model.decoder):
        retie(module)
    assert model.encoder.weight is model.decoder.weight
    assert fsdp.ensure_weights_retied(reinit, torch.nn.Linear(2, 2), torch.device("cpu")) is reinit


def test_pure_fsdp_helpers():
    names = {"_orig_mod.layer._checkpoint_wrapped_module.weight": 1, "block._orig_mod.bias": 2}
    assert fsdp.fsdp2_canonicalize_names(names) == {"layer.weight": 1, "block.bias": 2}
    old, new = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([old], lr=0.1)
    fsdp.fsdp2_switch_optimizer_parameters(optimizer, {old.data_ptr: new})
    assert optimizer.param_groups[0]["params"][0] is new
    with pytest.raises(KeyError, match="couldn't be switched"):
        fsdp.fsdp2_switch_optimizer_parameters(optimizer, {})
    assert isinstance(fsdp.get_fsdp2_grad_scaler(device="cpu", init_scale=4.0), torch.amp.GradScaler)


def test_parameters_from_modules_as_hf():
    """FSDP2's ignored parameters from a plugin's `ignored_modules` (TRL imports the helper at start-up): modules,
    a regex fully matching qualified module names (the matches moved to the device), or None."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU()))
    assert fsdp.get_parameters_from_modules(None, model, "cpu") == set()
    assert fsdp.get_parameters_from_modules([model[0]], model, "cpu") == {model[0].weight, model[0].bias}
    assert fsdp.get_parameters_from_modules(r"1\.\d", model, "cpu") == {model[1][0].weight, model[1][0].bias}
    assert fsdp.get_parameters_from_modules("1", model, "cpu") == set(model[1].parameters())
    assert fsdp.get_parameters_from_modules("0.weight", model, "cpu") == set()  # names modules, not parameters
    moved = fsdp.get_parameters_from_modules("0", model, "meta")
    assert moved == {model[0].weight, model[0].bias} and model[0].weight.is_meta and not model[1][0].weight.is_meta


def test_layer_inspection(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    assert not fp8.has_ao_layers(model) and not fp8.has_transformer_engine_layers(model)
    assert not has_4bit_bnb_layers(model)
    fake = types.ModuleType("bitsandbytes")
    fake.nn = types.SimpleNamespace(Linear4bit=torch.nn.Linear)  # any model Linear now counts as one
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    assert has_4bit_bnb_layers(model)
    assert fp8.find_first_last_linear_layers(model) == ("0", "2")
    assert not fp8.filter_first_and_last_linear_layers(model, "0")
    assert fp8.filter_first_and_last_linear_layers(model, "1")
    assert not fp8.filter_linear_layers(torch.nn.Linear(10, 16), "x", [])


@pytest.mark.parametrize(
    ("call", "feature", "asked_by"),
    [
        (lambda m: fsdp.save_fsdp_model(None, None, m, "out"), "FSDP", "save_fsdp_model"),
        (lambda m: fsdp.load_fsdp_optimizer(None, None, None, m, "in"), "FSDP", "load_fsdp_optimizer"),
        (lambda m: fsdp.fsdp2_prepare_model(None, m), "FSDP", "fsdp2_prepare_model"),
        (lambda m: fp8.convert_model_to_fp8_ao(m), "FP8 training (torchao)", "convert_model_to_fp8_ao"),
        (lambda m: fp8.apply_fp8_autowrap(m, None), "FP8 training (TransformerEngine)", "apply_fp8_autowrap"),
        (lambda m: fp8.convert_model(m), "TransformerEngine", "convert_model"),
        (lambda m: load_and_quantize_model(m, None), "bitsandbytes", "load_and_quantize_model"),
        (lambda m: megatron.GPTTrainStep(None, None), "Megatron-LM", "GPTTrainStep"),
        (lambda m: megatron.MegatronLMDummyDataLoader(data_path="x"), "Megatron-LM", "MegatronLMDummyDataLoader"),
        (lambda m: megatron.avg_losses_across_data_parallel_group([]), "Megatron-LM", "avg_losses"),
        (lambda m: accel.utils.install_xla(), "TPU/XLA", "install_xla"),
        (lambda m: accel.utils.get_grad_scaler(accel.DistributedType.FSDP), "FSDP gradient scaler", "get_grad_scaler"),
    ],
)
def test_helpers_that_need_an_engine_refuse(call, feature, asked_by):
    _refused(lambda: call(torch.nn.Linear(2, 2)), feature, asked_by)


def test_hf_module_paths_resolve():
    from accel.utils import deepspeed as ds_utils
    from accel.utils import fsdp_utils, megatron_lm, transformer_engine
    from accel.utils.ao import has_ao_layers
    from accel.utils.bnb import has_4bit_bnb_layers as bnb_layers
    from accel.utils.dataclasses import ProfileKwargs, TERecipeKwargs
    from accel.utils.torch_xla import install_xla

    assert ds_utils.DummyOptim is deepspeed.DummyOptim and fsdp_utils.save_fsdp_model is fsdp.save_fsdp_model
    assert megatron_lm.MegatronLMDummyScheduler and transformer_engine.convert_model and has_ao_layers and bnb_layers
    assert ProfileKwargs and TERecipeKwargs is fp8.TERecipeKwargs and install_xla


def test_import_accel_binds_utils_lazily():
    code = (
        "import sys, accel; utils = accel.utils; assert 'torch' not in sys.modules, 'torch imported'; "
        "accel.utils.gather; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_downcast_bf16_from_a_launcher_is_accepted(monkeypatch):
    # HF reads it on TPUs only: on CPUs and GPUs it changes nothing, in HF Accelerate as in accel (the launcher warns).
    monkeypatch.setenv("ACCELERATE_DOWNCAST_BF16", "1")
    assert Accelerator(cpu=True).mixed_precision == "no"
