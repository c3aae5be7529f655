"""HF Accelerate's several-DeepSpeed-plugin tests (its tests/deepspeed/test_deepspeed_multiple_model.py:
test_select_plugin, test_config_reference_update, test_enable_disable_manually_set, test_multiple_accelerators,
test_prepare_multiple_models_zero3_inference) in one CPU process: `deepspeed_plugin={name: plugin}`, the first one
active, `state.select_deepspeed_plugin` switching (and the config transformers sees with it), a second engine built
under another plugin. A tiny GPT-2 built from its config stands for hf-internal-testing/tiny-random-gpt2.
"""

import importlib.util
import logging

import pytest
import torch
from ds_helpers import tiny_gpt2, zero2_config, zero3_config, zero3_model_only_config

from accel.backends.deepspeed import (
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    get_active_deepspeed_plugin,
)
from accel.test_utils.training import RegressionDataset
from accel.utils.imports import deepspeed_required

if importlib.util.find_spec("deepspeed") is None:  # not imported here: accel imports it for the device it runs on
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)
pytest.importorskip("transformers")


def ds_plugins(zero3_inference: bool = False) -> dict:
    """HF's get_ds_plugins: a ZeRO-2 training plugin first, then ZeRO-3 (training, or the model-only inference one)."""
    zero3 = zero3_model_only_config() if zero3_inference else zero3_config()
    return {"zero2": DeepSpeedPlugin(hf_ds_config=zero2_config()), "zero3": DeepSpeedPlugin(hf_ds_config=zero3)}


def test_select_plugin(new_accelerator):
    """HF's test_select_plugin: the first plugin is active; select_deepspeed_plugin switches, and every view
    (selected, get_active_deepspeed_plugin, accelerator.deepspeed_plugin, get_deepspeed_plugin) agrees."""
    plugins = ds_plugins()
    zero2, zero3 = plugins.values()
    accelerator = new_accelerator(deepspeed_plugin=plugins)
    for switch_to, active, inactive in ((None, zero2, zero3), ("zero3", zero3, zero2), ("zero2", zero2, zero3)):
        if switch_to is not None:
            accelerator.state.select_deepspeed_plugin(switch_to)
        name = switch_to or "zero2"
        assert active.selected and not inactive.selected
        assert get_active_deepspeed_plugin(accelerator.state) is active
        assert accelerator.deepspeed_plugin is active and accelerator.state.deepspeed_plugin is active
        assert accelerator.state.get_deepspeed_plugin(name) is active
        assert accelerator.deepspeed_config is active.deepspeed_config


def test_deepspeed_plugins_keyword_is_an_alias(new_accelerator):
    """`Accelerator(deepspeed_plugins={...})` (HF's alias) does what `deepspeed_plugin={...}` does."""
    plugins = ds_plugins()
    accelerator = new_accelerator(deepspeed_plugins=plugins)
    assert accelerator.state.deepspeed_plugins is plugins and accelerator.deepspeed_plugin is plugins["zero2"]


def test_config_reference_update(new_accelerator):
    """HF's test_config_reference_update: transformers sees the active plugin's config (with its batch-size "auto"
    values replaced), and the other one's after a switch."""
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    plugins = ds_plugins(zero3_inference=True)
    zero2, zero3 = plugins.values()
    accelerator = new_accelerator(deepspeed_plugin=plugins)
    assert accelerator.deepspeed_plugin is zero2
    zero2.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    zero2.deepspeed_config.pop("train_batch_size")
    assert deepspeed_config() == accelerator.deepspeed_plugin.hf_ds_config.config and not is_deepspeed_zero3_enabled()

    accelerator.state.select_deepspeed_plugin("zero3")
    assert accelerator.deepspeed_plugin is zero3
    assert deepspeed_config() == accelerator.deepspeed_plugin.hf_ds_config.config and is_deepspeed_zero3_enabled()


def test_enable_disable_manually_set(new_accelerator):
    """HF's test_enable_disable_manually_set: a plugin is selected only through the state, and `selected` cannot be
    assigned."""
    plugins = ds_plugins()
    zero2 = plugins["zero2"]
    with pytest.raises(ValueError, match="must be enabled manually"):
        zero2.select()
    accelerator = new_accelerator(deepspeed_plugin=plugins)
    accelerator.state.select_deepspeed_plugin("zero2")
    with pytest.raises(NotImplementedError):
        zero2.selected = False
    assert zero2.selected


def test_multiple_accelerators(new_accelerator):
    """HF's test_multiple_accelerators: a second Accelerator cannot bring its own DeepSpeed plugin; without one it
    shares the first's."""
    plugins = ds_plugins()
    first = new_accelerator(deepspeed_plugin=plugins["zero2"])
    with pytest.raises(NotImplementedError, match="You cannot pass in a `deepspeed_plugin` when creating a second"):
        new_accelerator(deepspeed_plugin=plugins["zero3"])
    second = new_accelerator()
    assert second.deepspeed_plugin is first.deepspeed_plugin is plugins["zero2"]


def test_deepspeed_required_runs_under_deepspeed(new_accelerator):
    """`deepspeed_required` functions run once an Accelerator runs DeepSpeed (and raise without: test_availability)."""

    accelerator = new_accelerator(deepspeed_plugin=ds_plugins())

    @deepspeed_required
    def active_stage():
        return get_active_deepspeed_plugin(accelerator.state).zero_stage

    assert active_stage() == 2
    accelerator.state.select_deepspeed_plugin("zero3")
    assert active_stage() == 3


def test_prepare_multiple_models_zero3_inference(dist_env, new_accelerator, caplog):
    """HF's test_prepare_multiple_models_zero3_inference: a ZeRO-2 training engine, then, under the ZeRO-3 inference
    plugin, a second engine for another model; backward stays tied to the first, with HF's warning."""
    accelerator = new_accelerator(deepspeed_plugin=ds_plugins(zero3_inference=True))
    model1 = tiny_gpt2(causal_lm=True)
    optimizer = DummyOptim(model1.parameters())
    scheduler = DummyScheduler(optimizer)
    dataloader = torch.utils.data.DataLoader(RegressionDataset(), batch_size=1)
    model1, optimizer, scheduler, dataloader = accelerator.prepare(model1, optimizer, scheduler, dataloader)
    assert model1.zero_optimization_stage() == 2

    accelerator.state.select_deepspeed_plugin("zero3")
    model2 = tiny_gpt2(causal_lm=True)  # built partitioned: transformers now sees the ZeRO-3 config
    with caplog.at_level(logging.WARNING):
        model2 = accelerator.prepare(model2)
    assert "A wrapped DeepSpeed engine reference is currently tied for this `Accelerator()` instance." in caplog.text
    assert accelerator.deepspeed_engine_wrapped.engine is model1
    assert model2.zero_optimization_stage() == 3
    with torch.no_grad():  # the inference engine runs
        assert model2(input_ids=torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)
