"""The config file: HF Accelerate's files load, errors name file + key + what is allowed, saves are atomic."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

import accel.cli.basic_config as basic_config_module
from accel.cli.basic_config import write_basic_config
from accel.cli.config_file import (
    ClusterConfig,
    ConfigError,
    default_config_path,
    find_config_file,
    hf_default_config_path,
    load_config,
    save_config,
)
from accel.unsupported import UnsupportedFeatureError

# What `accelerate config` writes (HF Accelerate 0.2x) for two CPU machines with IPEX and mpirun.
HF_MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
ipex_config:
  ipex: true
machine_rank: 0
main_process_ip: 192.168.1.10
main_process_port: 29500
main_training_function: main
mixed_precision: bf16
mpirun_config:
  mpirun_ccl: '1'
  mpirun_hostfile: /home/user/hostfile
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

# What `accelerate config` writes for one machine with two GPUs and torch dynamo.
HF_MULTI_GPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_mode: max-autotune
  dynamo_use_dynamic: false
  dynamo_use_fullgraph: true
  dynamo_use_regional_compilation: false
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# A DeepSpeed config, as HF Accelerate 1.15 writes it.
HF_DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
fsdp_config: {}
machine_rank: 0
main_training_function: main
megatron_lm_config: {}
mixed_precision: fp16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# What HF Accelerate's write_basic_config writes: JSON, even into default_config.yaml.
HF_BASIC_JSON = """\
{
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "NO",
  "downcast_bf16": false,
  "enable_cpu_affinity": false,
  "machine_rank": 0,
  "main_training_function": "main",
  "mixed_precision": "no",
  "num_machines": 1,
  "num_processes": 1,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": true
}
"""


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Point every default location into tmp_path so that no test reads or writes the real ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(tmp_path / "accel_config.yaml"))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- round trip and saving ---------------------------------------------------------------------------


def sample_config() -> ClusterConfig:
    return ClusterConfig(
        distributed_type="MULTI_GPU",
        mixed_precision="bf16",
        num_processes=4,
        num_machines=2,
        machine_rank=1,
        gpu_ids="0,1",
        main_process_ip="10.0.0.1",
        main_process_port=29500,
        same_network=True,
        dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True},
    )


@pytest.mark.parametrize("name", ["config.yaml", "config.json"])
def test_round_trip(tmp_path, name):
    config = sample_config()
    path = save_config(config, tmp_path / "nested" / "dir" / name)
    loaded = load_config(path)
    assert loaded == config
    assert loaded.source == str(path)


def test_saved_yaml_is_plain_sorted_yaml_without_empty_values(tmp_path):
    path = save_config(sample_config(), tmp_path / "config.yaml")
    text = path.read_text()
    data = yaml.safe_load(text)
    top_level_keys = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert top_level_keys == sorted(data)
    assert data["distributed_type"] == "MULTI_GPU"
    assert data["dynamo_config"] == {"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True}
    # Like HF: None values and empty mappings are left out.
    assert "deepspeed_config" not in data and "tpu_name" not in data and "source" not in data


def test_save_replaces_atomically_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = save_config(ClusterConfig(mixed_precision="fp16"), tmp_path / "config.yaml")
    save_config(ClusterConfig(mixed_precision="bf16"), path)
    assert load_config(path).mixed_precision == "bf16"

    def failing_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(ConfigError, match="cannot write the config file: disk full"):
        save_config(ClusterConfig(mixed_precision="no"), path)
    assert load_config(path).mixed_precision == "bf16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClusterConfig().num_processes = 2


# --- HF Accelerate's files ---------------------------------------------------------------------------


def test_hf_multi_cpu_config_loads(tmp_path):
    config = load_config(write(tmp_path / "default_config.yaml", HF_MULTI_CPU))
    assert config.distributed_type == "MULTI_CPU"
    assert (config.num_processes, config.num_machines, config.main_process_port) == (8, 2, 29500)
    assert config.ipex_config == {"ipex": True}
    assert config.mpirun_config == {"mpirun_ccl": "1", "mpirun_hostfile": "/home/user/hostfile"}
    assert config.use_cpu is True and config.downcast_bf16 == "no" and config.tpu_env == []
    # HF launches such a file through mpirun; accel refuses rather than start it another way.
    with pytest.raises(UnsupportedFeatureError, match=r"mpirun .*asked for by .*mpirun_config.mpirun_hostfile"):
        config.check_supported()
    dataclasses.replace(config, mpirun_config={"mpirun_ccl": "1"}).check_supported()


def test_hf_multi_gpu_config_loads_and_round_trips(tmp_path):
    config = load_config(write(tmp_path / "default_config.yaml", HF_MULTI_GPU))
    assert (config.distributed_type, config.num_processes, config.gpu_ids) == ("MULTI_GPU", 2, "all")
    assert config.dynamo_config["dynamo_backend"] == "INDUCTOR"
    assert config.dynamo_config["dynamo_mode"] == "max-autotune"
    config.check_supported()
    assert config.to_dict() == yaml.safe_load(HF_MULTI_GPU)


def test_hf_basic_config_in_json_loads_from_both_suffixes(tmp_path):
    from_json = load_config(write(tmp_path / "config.json", HF_BASIC_JSON))
    from_yaml = load_config(write(tmp_path / "default_config.yaml", HF_BASIC_JSON))
    assert from_json == from_yaml
    assert (from_json.distributed_type, from_json.use_cpu, from_json.num_processes) == ("NO", True, 1)


def test_hf_deepspeed_config_loads_round_trips_and_is_supported(tmp_path):
    path = write(tmp_path / "default_config.yaml", HF_DEEPSPEED)
    config = load_config(path)
    assert config.deepspeed_config["zero_stage"] == 2
    config.check_supported()
    written = config.to_dict()
    assert {key: value for key, value in yaml.safe_load(HF_DEEPSPEED).items() if value != {}} == {
        key: value for key, value in written.items() if key != "enable_cpu_affinity"
    }  # (not in this older file)


def test_unsupported_distributed_type_loads_but_is_refused_when_checked(tmp_path):
    path = write(tmp_path / "default_config.yaml", HF_DEEPSPEED.replace("DEEPSPEED", "MEGATRON_LM"))
    config = load_config(path)
    with pytest.raises(UnsupportedFeatureError) as error:
        config.check_supported()
    assert error.value.feature == "Megatron-LM" and error.value.asked_by == f"{path}: distributed_type: MEGATRON_LM"
    assert "--multi_gpu" in error.value.instead


@pytest.mark.parametrize(
    "kind,feature", [("XLA", "TPU"), ("MEGATRON_LM", "Megatron-LM"), ("MULTI_NPU", "other than CUDA GPUs")]
)
def test_every_unsupported_distributed_type_names_its_backend(kind, feature):
    config = ClusterConfig.from_dict({"distributed_type": kind}, source="c.yaml")
    with pytest.raises(UnsupportedFeatureError, match=f"{feature}.*asked for by c.yaml: distributed_type: {kind}"):
        config.check_supported()


def test_a_parallelism_config_loads_round_trips_and_is_checked_at_launch():
    parallelism = {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}
    config = ClusterConfig.from_dict({"distributed_type": "FSDP", "parallelism_config": parallelism}, "c.yaml")
    config.check_supported()  # tp_size 2 is refused when the launch settings are resolved, where flags can override
    assert config.to_dict()["parallelism_config"] == parallelism


@pytest.mark.parametrize(
    "parallelism,message",
    [
        (
            {"tp_size": 2},
            "c.yaml: parallelism_config.tp_size: 2 is not valid; unknown key (did you mean "
            "'parallelism_config_tp_size'?)",
        ),
        (
            {"parallelism_config_dp_shard_size": 0},
            "c.yaml: parallelism_config.parallelism_config_dp_shard_size: 0 is not valid; expected an integer >= 1",
        ),
        ({"parallelism_config_cp_comm_strategy": "ring"}, "allowed values: allgather, alltoall"),
    ],
)
def test_a_bad_parallelism_config_key_or_value_names_the_file_and_key(parallelism, message):
    with pytest.raises(ConfigError) as error:
        ClusterConfig.from_dict({"distributed_type": "FSDP", "parallelism_config": parallelism}, "c.yaml")
    assert message in str(error.value) and error.value.key == f"parallelism_config.{next(iter(parallelism))}"


def test_legacy_hf_keys_are_converted():
    config = ClusterConfig.from_dict({"distributed_type": "NO", "fp16": True, "dynamo_backend": "eager"})
    assert config.mixed_precision == "fp16"
    assert config.dynamo_config == {"dynamo_backend": "EAGER"}
    assert config.num_processes == 1


def test_unquoted_yaml_no_is_read_as_no(tmp_path):
    # YAML 1.1 reads unquoted NO / no as false.
    config = load_config(write(tmp_path / "c.yaml", "distributed_type: NO\nmixed_precision: no\n"))
    assert (config.distributed_type, config.mixed_precision, config.num_processes) == ("NO", "no", 1)
    config = load_config(write(tmp_path / "c.yaml", "distributed_type: MULTI_CPU\n"))
    assert config.num_processes == -1  # HF's default: the launcher decides


# --- errors: each names the file, the key and what is allowed ------------------------------------------


@pytest.mark.parametrize(
    "text, key, fragments",
    [
        ("distributed_type: NO\nmixed_precision: fp12\n", "mixed_precision", ["'fp12'", "'no', 'fp16', 'bf16', 'fp8'"]),
        ("distributed_type: MULTI_CPU\nnum_processes: two\n", "num_processes", ["'two'", "expected an integer"]),
        ("distributed_type: MULTI_CPU\nuse_cpu: maybe\n", "use_cpu", ["'maybe'", "true or false"]),
        ("distributed_type: SOMETIMES\n", "distributed_type", ["'SOMETIMES'", "'MULTI_CPU'", "'DEEPSPEED'"]),
        ("mixed_precision: fp16\n", "distributed_type", ["missing", "'MULTI_GPU'"]),
        (
            "distributed_type: NO\ndynamo_config:\n  dynamo_backend: turbo\n",
            "dynamo_config.dynamo_backend",
            ["'turbo'", "'INDUCTOR'", "'EAGER'"],
        ),
        (
            "distributed_type: NO\ndynamo_config:\n  backend: inductor\n",
            "dynamo_config.backend",
            ["allowed keys", "'dynamo_backend'"],
        ),
        ("distributed_type: NO\nmain_process_port: 70000\n", "main_process_port", ["70000", "between 1 and 65535"]),
        ("distributed_type: NO\ngpu_ids: first\n", "gpu_ids", ["'first'", "'all'"]),
        ("distributed_type: MULTI_CPU\nnum_machines: 2\nmachine_rank: 2\n", "machine_rank", ["between 0 and 1"]),
        (
            "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\nec2_instance_type: ml.p3\n",
            "compute_environment",
            ["SageMaker", "not supported by accel yet", "'LOCAL_MACHINE'"],
        ),
    ],
)
def test_bad_values_name_file_key_and_allowed_values(tmp_path, text, key, fragments):
    path = write(tmp_path / "default_config.yaml", text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(str(path))
    assert key in message and error.value.key == key and error.value.path == str(path)
    for fragment in fragments:
        assert fragment in message


def test_unknown_keys_are_listed_with_suggestions(tmp_path):
    path = write(tmp_path / "c.yaml", "distributed_type: NO\nmixed_presicion: fp16\nbatch_size: 8\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message and "unknown keys" in message
    assert "'batch_size'" in message and "'mixed_presicion' (did you mean 'mixed_precision'?)" in message
    assert "allowed keys: " in message and "num_processes" in message


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        ("c.yaml", "distributed_type: [NO\n", "invalid YAML"),
        ("c.json", '{"distributed_type": "NO",}', "invalid JSON"),
        ("c.yaml", "- distributed_type: NO\n", "top level must be a mapping of keys to values, found a list"),
        ("c.yaml", "", "found an empty file"),
    ],
)
def test_unparsable_files_are_reported(tmp_path, name, text, fragment):
    path = write(tmp_path / name, text)
    with pytest.raises(ConfigError, match="^" + str(path)) as error:
        load_config(path)
    assert fragment in str(error.value)


def test_missing_and_unreadable_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.yaml")
    # A directory stands in for an unreadable file: the tests may run as root, where modes are ignored.
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path)


# --- default locations -------------------------------------------------------------------------------


def test_default_path_precedence(tmp_path, monkeypatch):
    assert default_config_path() == tmp_path / "accel_config.yaml"
    monkeypatch.delenv("ACCEL_CONFIG_FILE")
    assert default_config_path() == tmp_path / "xdg" / "accel" / "default_config.yaml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_config_path() == tmp_path / "home" / ".cache" / "accel" / "default_config.yaml"


def test_hf_default_path_precedence(tmp_path, monkeypatch):
    assert hf_default_config_path() == tmp_path / "hf" / "accelerate" / "default_config.yaml"
    monkeypatch.delenv("HF_HOME")
    assert hf_default_config_path() == tmp_path / "xdg" / "huggingface" / "accelerate" / "default_config.yaml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    expected = tmp_path / "home" / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert hf_default_config_path() == expected


def test_find_config_file_prefers_accel_then_falls_back_to_hf(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCEL_CONFIG_FILE")
    monkeypatch.delenv("HF_HOME")
    assert find_config_file() is None
    hf_file = write(tmp_path / "xdg" / "huggingface" / "accelerate" / "default_config.yaml", HF_MULTI_GPU)
    assert find_config_file() == hf_file
    accel_file = write(tmp_path / "xdg" / "accel" / "default_config.yaml", HF_MULTI_CPU)
    assert find_config_file() == accel_file


# --- write_basic_config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpus, expected",
    [(0, ("NO", True, 1)), (1, ("NO", False, 1)), (4, ("MULTI_GPU", False, 4))],
)
def test_write_basic_config_describes_this_machine(monkeypatch, tmp_path, gpus, expected):
    monkeypatch.setattr(basic_config_module, "_cuda_device_count", lambda: gpus)
    path = write_basic_config(mixed_precision="BF16")
    assert path == tmp_path / "accel_config.yaml"  # the default, resolved at call time
    config = load_config(path)
    assert (config.distributed_type, config.use_cpu, config.num_processes) == expected
    assert config.mixed_precision == "bf16"


def test_write_basic_config_does_not_overwrite(tmp_path):
    path = write(tmp_path / "c.yaml", HF_MULTI_GPU)
    assert write_basic_config(mixed_precision="fp16", save_location=path) is False
    assert path.read_text() == HF_MULTI_GPU


def test_write_basic_config_rejects_unknown_precision(tmp_path):
    with pytest.raises(ValueError, match="'no', 'fp16', 'bf16', 'fp8'"):
        write_basic_config(mixed_precision="fp12", save_location=tmp_path / "c.yaml")
    assert not (tmp_path / "c.yaml").exists()
