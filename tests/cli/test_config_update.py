"""`accel config update`, `accel to-fsdp2` and `accel tpu-config`: HF Accelerate's config subcommands."""

import json
import textwrap

import yaml

from accel.cli.config_file import load_config
from accel.cli.launch import child_env, resolve
from accel.cli.main import main
from accel.cli.to_fsdp2 import convert_config_to_fsdp2

# Written by an old HF Accelerate: legacy `fp16` and top-level `dynamo_backend` keys, few others.
LEGACY = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
fp16: true
dynamo_backend: INDUCTOR
num_processes: 2
"""

FSDP1 = """\
distributed_type: FSDP
mixed_precision: bf16
num_processes: 2
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
"""


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_update_upgrades_legacy_keys_and_writes_every_current_key(tmp_path, capsys):
    path = write(tmp_path / "old.yaml", LEGACY)
    assert main(["config", "update", "--config_file", str(path)]) == 0
    assert f"Successfully updated the configuration file at {path}." in capsys.readouterr().out
    written = yaml.safe_load(path.read_text())
    assert "fp16" not in written and "dynamo_backend" not in written
    assert written["mixed_precision"] == "fp16" and written["dynamo_config"] == {"dynamo_backend": "INDUCTOR"}
    assert written["enable_cpu_affinity"] is False and written["rdzv_backend"] == "static"
    assert load_config(path).num_processes == 2


def test_update_keeps_json_and_defaults_to_the_default_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    default = tmp_path / "cache" / "accel" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(json.dumps({"distributed_type": "NO", "fp16": False}))  # HF's write_basic_config: JSON text
    assert main(["config", "update"]) == 0
    assert yaml.safe_load(default.read_text())["mixed_precision"] == "no"
    path = write(tmp_path / "c.json", json.dumps({"distributed_type": "NO"}))
    assert main(["config", "update", "--config_file", str(path)]) == 0
    assert json.loads(path.read_text())["num_processes"] == 1


def test_update_of_a_missing_or_bad_file_is_a_clear_error(tmp_path, capsys):
    assert main(["config", "update", "--config_file", str(tmp_path / "nope.yaml")]) == 2
    assert "accel config: error:" in capsys.readouterr().err
    bad = write(tmp_path / "bad.yaml", "distributed_type: NO\nnum_proceses: 2\n")
    assert main(["config", "update", "--config_file", str(bad)]) == 2
    assert "'num_proceses' (did you mean 'num_processes'?)" in capsys.readouterr().err
    assert "num_proceses" in bad.read_text()  # left as it was


def fsdp_variables(config_file) -> dict[str, str]:
    """The FSDP variables `accel launch --config_file CONFIG_FILE` exports to the ranks."""
    env = child_env(resolve({"config_file": str(config_file)}, environ={}), environ={})
    return {name: value for name, value in env.items() if "FSDP" in name}


def test_to_fsdp2_converts_hf_accelerates_keys(tmp_path, caplog):
    source, output = write(tmp_path / "fsdp1.yaml", FSDP1), tmp_path / "fsdp2.yaml"
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(output)]) == 0
    fsdp = yaml.safe_load(output.read_text())["fsdp_config"]
    assert fsdp == {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "BertLayer",
    }
    assert load_config(output).distributed_type == "FSDP" and source.read_text() == FSDP1
    assert "FSDP1 to FSDP2: SHARD_GRAD_OP → reshard_after_forward false" in caplog.text
    # One rule: `accel launch` runs the FSDP1 file with the converted file's variables.
    assert fsdp_variables(source) == fsdp_variables(output)
    assert fsdp_variables(output)["FSDP_RESHARD_AFTER_FORWARD"] == "false"


def test_to_fsdp2_output_rules(tmp_path, capsys):
    source = write(tmp_path / "fsdp1.yaml", FSDP1)
    assert main(["to-fsdp2", "--config_file", str(source)]) == 2
    assert "give --output_file, or --overwrite" in capsys.readouterr().err
    taken = write(tmp_path / "taken.yaml", "x")
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(taken)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["to-fsdp2", "--config_file", str(source), "--overwrite"]) == 0
    assert yaml.safe_load(source.read_text())["fsdp_config"]["fsdp_version"] == 2


def test_to_fsdp2_leaves_fsdp2_and_non_fsdp_configs_alone():
    already = {"fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}
    assert convert_config_to_fsdp2(already) == already
    assert convert_config_to_fsdp2({"distributed_type": "NO"}) == {"distributed_type": "NO"}


def test_tpu_config_parses_hf_options_and_refuses(capsys):
    argv = ["tpu-config", "--tpu_name", "pod", "--tpu_zone", "z", "--command", "echo", "hi", "--install_accelerate"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "accel tpu-config: error: Running on TPU pods is not supported by accel (asked for by "
        "accel tpu-config --tpu_name --tpu_zone --command)"
    )
