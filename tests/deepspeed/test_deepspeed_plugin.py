"""HF Accelerate's DeepSpeed plugin and config tests (its tests/deepspeed/test_deepspeed.py, DeepSpeedConfigIntegration:
test_deepspeed_plugin, test_ds_config, test_ds_config_assertions, test_accelerate_state_deepspeed, test_init_zero3,
test_autofill_dsconfig_from_ds_plugin), ported to accel on CPU processes: bf16 where HF also runs fp16 (DeepSpeed's
CPU accelerator has no fp16, which accel refuses naming both). Beyond HF's cases: the launcher variables and config
sources a plugin reads, and the ImportError naming the install command when DeepSpeed is missing.

HF runs these on a GPU only; none needs one, nor an engine: an Accelerator here only starts a process group of one.
"""

import base64
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from ds_helpers import FILL_KWARGS, zero2_config, zero3_config

from accel.backends.deepspeed import INSTALL, DeepSpeedPlugin, HfDeepSpeedConfig
from accel.state import AcceleratorState, DistributedType

if importlib.util.find_spec("deepspeed") is None:  # not imported here: accel imports it for the device it runs on
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

STAGES = {"zero2": zero2_config, "zero3": zero3_config}
# What HF's tests build with ZeRO-3 init on and everything offloaded.
OFFLOADED = dict(
    gradient_accumulation_steps=1,
    gradient_clipping=1.0,
    offload_optimizer_device="cpu",
    offload_param_device="cpu",
    zero3_save_16bit_model=True,
    zero3_init_flag=True,
)


def config_file(folder, config: dict, name: str = "ds_config.json") -> str:
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(config, file)
    return path


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_plugin(tmp_path, stage):
    """HF's test_deepspeed_plugin: ZeRO-3 init only under stage 3, a config file's stage decides it, accumulation
    steps default to 1, a config without `zero_optimization` is refused, `deepspeed_config_process` fills "auto"
    values, lists every mismatch, and names an "auto" key the kwargs lack."""
    with pytest.warns(UserWarning, match="Zero3 Init flag is only applicable for ZeRO Stage 3"):
        assert not DeepSpeedPlugin(zero_stage=2, **OFFLOADED).zero3_init_flag
    assert DeepSpeedPlugin(zero_stage=3, **OFFLOADED).zero3_init_flag

    path = config_file(tmp_path, STAGES[stage]())
    if stage == "zero2":
        with pytest.warns(UserWarning, match="Zero3 Init flag"):
            assert not DeepSpeedPlugin(hf_ds_config=path, zero3_init_flag=True).zero3_init_flag
    else:
        assert DeepSpeedPlugin(hf_ds_config=path, zero3_init_flag=True).zero3_init_flag

    without_steps = STAGES[stage]()
    del without_steps["gradient_accumulation_steps"]
    plugin = DeepSpeedPlugin(hf_ds_config=config_file(tmp_path, without_steps, "without_steps.json"))
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1

    without_zero = STAGES[stage]()
    del without_zero["zero_optimization"]
    with pytest.raises(ValueError, match="Please specify the ZeRO optimization config in the DeepSpeed config."):
        DeepSpeedPlugin(hf_ds_config=config_file(tmp_path, without_zero, "without_zero.json"))

    plugin = DeepSpeedPlugin(hf_ds_config=path)
    plugin.deepspeed_config_process(**FILL_KWARGS)
    for key, value in FILL_KWARGS.items():
        node, leaf = plugin.hf_ds_config.find_config_node(key)
        if node is not None and node.get(leaf) is not None:
            assert node[leaf] == value, key

    mismatches = {"optimizer.params.lr": 1e-5, "optimizer.params.weight_decay": 1e-5, "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError, match="mismatch kwargs") as raised:
        plugin.deepspeed_config_process(**{**FILL_KWARGS, **mismatches})
    for key in mismatches:
        assert key in str(raised.value)

    plugin.deepspeed_config["optimizer"]["params"]["lr"] = "auto"
    without_lr = {key: value for key, value in FILL_KWARGS.items() if key != "optimizer.params.lr"}
    with pytest.raises(ValueError, match="`optimizer.params.lr` not found in kwargs."):
        plugin.deepspeed_config_process(**without_lr)


@pytest.mark.parametrize("stage", STAGES)
def test_ds_config(tmp_path, stage):
    """HF's test_ds_config: the plugin's `zero_stage` is the config file's."""
    plugin = DeepSpeedPlugin(hf_ds_config=config_file(tmp_path, STAGES[stage]()), zero3_init_flag=True)
    assert plugin.zero_stage == int(stage.removeprefix("zero"))


def test_plugin_fields_come_from_the_launcher_variables(monkeypatch, tmp_path):
    """What `accelerate launch --use_deepspeed` exports (ACCELERATE_*; accel's ACCEL_* too) fills the unset fields,
    and ACCELERATE_DEEPSPEED_CONFIG_FILE names the config."""
    for name, value in {
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_GRADIENT_CLIPPING": "0.5",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
    }.items():
        monkeypatch.setenv(name, value)
    plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    assert (plugin.gradient_accumulation_steps, plugin.gradient_clipping, plugin.zero_stage) == (4, 0.5, 3)
    assert config["gradient_accumulation_steps"] == 4 and config["gradient_clipping"] == 0.5
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "nvme_path": None}
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "nvme_path": None}
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] == "auto"
    assert plugin.zero3_init_flag is False  # the variable overrides "on under stage 3"

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", config_file(tmp_path, zero2_config()))
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    from_file = DeepSpeedPlugin()
    assert from_file.zero_stage == 2 and from_file.deepspeed_config["optimizer"]["type"] == "AdamW"


def test_defaults_without_variables(monkeypatch):
    """HF's defaults: ZeRO-2, nothing offloaded, accumulation steps and clipping "auto", no 16-bit gathering."""
    for name in [name for name in os.environ if name.startswith(("ACCELERATE_", "ACCEL_"))]:
        monkeypatch.delenv(name)
    plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == 2 and zero["stage"] == 2 and not plugin.zero3_init_flag
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == plugin.gradient_clipping == "auto"
    assert plugin.deepspeed_config["gradient_clipping"] == "auto"
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False


def test_config_sources(tmp_path):
    """A config is read from a path, a dict (copied: the caller's stays reusable), JSON text, urlsafe base64 JSON,
    or an HfDeepSpeedConfig (kept as given); anything else is refused naming what was received."""
    config = zero3_config()
    text = json.dumps(config)
    sources = [config_file(tmp_path, config), config, text, base64.urlsafe_b64encode(text.encode()).decode()]
    for source in sources:
        plugin = DeepSpeedPlugin(hf_ds_config=source)
        assert plugin.zero_stage == 3 and plugin.hf_ds_config.is_zero3() and plugin.hf_ds_config.is_offload()
        plugin.deepspeed_config_process(**FILL_KWARGS)
    assert config == zero3_config()  # the dict given was not filled in
    given = HfDeepSpeedConfig(zero2_config())
    assert DeepSpeedPlugin(hf_ds_config=given).hf_ds_config is given
    with pytest.raises(ValueError, match="Expected a string path to an existing deepspeed config.*Received: nope"):
        DeepSpeedPlugin(hf_ds_config="nope")


def test_ds_config_assertions(monkeypatch, dist_env, tmp_path):
    """HF's test_ds_config_assertions: a config file together with the launcher's DeepSpeed fields (as
    ACCELERATE_CONFIG_DS_FIELDS lists them) is refused, saying which to drop."""
    monkeypatch.setenv(
        "ACCELERATE_CONFIG_DS_FIELDS",
        "gradient_accumulation_steps,gradient_clipping,zero_stage,"
        "offload_optimizer_device,offload_param_device,zero3_save_16bit_model,mixed_precision",
    )
    with pytest.raises(ValueError) as raised:
        DeepSpeedPlugin(
            hf_ds_config=config_file(tmp_path, zero3_config()),
            zero3_init_flag=True,
            gradient_accumulation_steps=1,
            gradient_clipping=1.0,
            zero_stage=2,
            offload_optimizer_device="cpu",
            offload_param_device="cpu",
            zero3_save_16bit_model=True,
        )
    # HF's sentence, with accel's name for the config file `accel config` writes.
    assert (
        "If you are using an accel config file, remove others config variables mentioned in the above specified list."
    ) in str(raised.value)


def test_accelerate_state_deepspeed(dist_env, new_accelerator):
    """HF's test_accelerate_state_deepspeed (bf16; fp16 is refused on CPU, below): the Accelerator's mixed
    precision enables the config's section, and the state's mixed precision is the config's."""
    plugin = DeepSpeedPlugin(zero_stage=2, **OFFLOADED)
    accelerator = new_accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    state = accelerator.state
    assert state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin is plugin
    assert state.deepspeed_plugin.deepspeed_config["bf16"]["enabled"] is True
    assert state.deepspeed_plugin.deepspeed_config["fp16"]["enabled"] is False
    assert state.mixed_precision == accelerator.mixed_precision == "bf16"


def test_an_accelerator_given_a_plugin_says_so_in_the_environment_as_hf_does(monkeypatch, new_accelerator):
    """HF's Accelerator sets ACCELERATE_USE_DEEPSPEED=true when given a plugin: a TrainingArguments made afterwards
    (transformers reads the variable) then builds its own DeepSpeed plugin."""
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    new_accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "true"


def test_fp16_is_refused_on_cpu(dist_env, new_accelerator):
    """DeepSpeed's CPU accelerator has no fp16 optimizer or loss scaler: fp16 asked for by the Accelerator or by
    the config is refused before anything starts, naming fp16 and the CPU."""
    with pytest.raises(ValueError, match=r"(?s)fp16.*CPU"):
        new_accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    AcceleratorState._reset_state(True)
    config = zero2_config()
    config["fp16"]["enabled"] = True
    with pytest.raises(ValueError, match=r"(?s)fp16.*CPU"):
        new_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))


def test_init_zero3(dist_env, new_accelerator):
    """HF's test_init_zero3: with ZeRO-3 init on, transformers sees ZeRO-3 (and would build models partitioned)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    new_accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, **OFFLOADED))
    assert is_deepspeed_zero3_enabled()


def test_autofill_dsconfig_from_ds_plugin(dist_env, new_accelerator):
    """HF's test_autofill_dsconfig_from_ds_plugin (bf16): "auto" entries of a config dict take the plugin's fields;
    a mixed precision contradicting the config's is refused; the accumulation steps come from the plugin, or for
    "auto" from the Accelerator (filled at prepare: tests/deepspeed/test_deepspeed_prepare.py)."""
    config = zero3_config()
    del config["fp16"]
    config["bf16"]["enabled"] = "auto"
    config["zero_optimization"].update(stage="auto", stage3_gather_16bit_weights_on_model_save="auto")
    config["zero_optimization"]["offload_optimizer"]["device"] = "auto"
    config["zero_optimization"]["offload_param"]["device"] = "auto"
    config.update(gradient_accumulation_steps="auto", gradient_clipping="auto")
    fields = dict(
        zero_stage=2,
        gradient_clipping=1.0,
        offload_optimizer_device="cpu",
        offload_param_device="cpu",
        zero3_save_16bit_model=True,
    )

    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=True, gradient_accumulation_steps=2, **fields)
    filled = new_accelerator(deepspeed_plugin=plugin, mixed_precision="bf16").state.deepspeed_plugin.deepspeed_config
    assert filled["gradient_clipping"] == 1.0 and filled["gradient_accumulation_steps"] == 2
    assert filled["zero_optimization"]["stage"] == 2
    assert filled["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert filled["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert filled["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert filled["bf16"]["enabled"] is True

    AcceleratorState._reset_state(True)
    with pytest.raises(
        ValueError,
        match="`--mixed_precision` arg cannot be set to `fp16` when `bf16` is set in the DeepSpeed config file.",
    ):
        new_accelerator(deepspeed_plugin=plugin, mixed_precision="fp16")

    AcceleratorState._reset_state(True)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=4)
    accelerator = new_accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    assert accelerator.state.deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"] == 4


def test_use_deepspeed_variable_builds_the_plugin(dist_env, monkeypatch, new_accelerator):
    """ACCELERATE_USE_DEEPSPEED (HF's `dist_env`) without a plugin: one built from the launcher's variables."""
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    accelerator = new_accelerator()
    assert accelerator.distributed_type == DistributedType.DEEPSPEED
    assert accelerator.deepspeed_plugin.zero_stage == 1
    assert accelerator.deepspeed_config["zero_optimization"]["stage"] == 1


# A meta path finder refusing DeepSpeed, as if it were not installed.
_HIDE_DEEPSPEED = """
import importlib.abc, json, sys

class HideDeepSpeed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideDeepSpeed())
"""

_WITHOUT_DEEPSPEED = (
    _HIDE_DEEPSPEED
    + """
from accel import Accelerator
from accel.backends.deepspeed import DeepSpeedPlugin
from accel.state import AcceleratorState

plugin = DeepSpeedPlugin(zero_stage=2)  # the config needs no DeepSpeed
errors = []
for kwargs in ({"deepspeed_plugin": plugin}, {}):  # the second: ACCELERATE_USE_DEEPSPEED=true
    try:
        Accelerator(**kwargs)
        errors.append(None)
    except ImportError as error:
        errors.append(str(error))
    AcceleratorState._reset_state(True)
print(json.dumps(errors))
"""
)


def test_missing_deepspeed_gives_one_import_error_with_the_install_command(monkeypatch):
    """Without DeepSpeed (hidden from a fresh interpreter), asking for it gives one ImportError naming the install
    command: from a plugin, and from ACCELERATE_USE_DEEPSPEED."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WITHOUT_DEEPSPEED)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert errors == [f"DeepSpeed is not installed => run `{INSTALL}`."] * 2
