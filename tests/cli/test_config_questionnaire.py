"""`accel config` and `accel config default`, run as the installed CLI with answers piped to stdin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from accel.cli.config import MACHINE_TYPE_OPTIONS, integer_between, parse_yes_no, pick_option
from accel.cli.config_file import load_config
from accel.cli.launch import child_env, resolve

ACCEL_SCRIPT = Path(sys.executable).with_name("accel")


def run_accel(tmp_path: Path, args: list[str], answers: list[str] | None = None, script: bool = False):
    """Run `python -m accel ARGS` (or the `accel` script) with every default location inside tmp_path."""
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "HF_HOME": str(tmp_path / "hf"),
        "ACCEL_CONFIG_FILE": str(tmp_path / "default_config.yaml"),
    }
    command = [str(ACCEL_SCRIPT)] if script else [sys.executable, "-m", "accel"]
    stdin = "".join(answer + "\n" for answer in answers or [])
    return subprocess.run(command + args, input=stdin, env=env, text=True, capture_output=True, timeout=60)


def saved_yaml(result, path: Path) -> dict:
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"accel configuration saved at {path}" in result.stdout
    load_config(path)  # what we write, we can read back
    return yaml.safe_load(path.read_text())


# --- the questionnaire -----------------------------------------------------------------------------------


def test_multi_cpu_answers_are_saved_with_hf_keys(tmp_path):
    path = tmp_path / "cpu.yaml"
    answers = ["This machine", "multi-CPU", "1", "no", "no", "no", "2", "fp16"]
    data = saved_yaml(run_accel(tmp_path, ["config", "--config_file", str(path)], answers), path)
    assert data["compute_environment"] == "LOCAL_MACHINE"
    assert (data["distributed_type"], data["num_processes"], data["num_machines"]) == ("MULTI_CPU", 2, 1)
    assert (data["mixed_precision"], data["use_cpu"], data["debug"]) == ("fp16", True, False)
    assert "ipex_config" not in data  # a "no" is not written: current HF Accelerate refuses the key
    assert "dynamo_config" not in data and "gpu_ids" not in data  # as HF: written only when asked


def test_dynamo_answers_are_saved_to_the_default_path(tmp_path):
    # No distributed training, CPU only, IPEX, dynamo with custom torch.compile settings, no DeepSpeed.
    answers = ["0", "0", "yes", "y", "yes", "eager", "y", "1", "true", "0", "", "no", "bf16"]
    result = run_accel(tmp_path, ["config"], answers)
    data = saved_yaml(result, tmp_path / "default_config.yaml")
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"]) == ("NO", 1, True)
    assert data["mixed_precision"] == "bf16" and "deepspeed_config" not in data
    assert data["ipex_config"] == {"ipex": True}
    assert data["dynamo_config"] == {
        "dynamo_backend": "EAGER",
        "dynamo_mode": "reduce-overhead",
        "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": False,
    }


def test_multi_node_answers(tmp_path):
    path = tmp_path / "nodes.yaml"
    answers = [
        "0",
        "multi-GPU",
        "2",
        "1",
        "10.1.2.3",
        "29501",
        "no",
        "c10d",
        "yes",  # machines, network, debug
        "",
        "",
        "",
        "4",
        "0,1",
        "fp16",  # no dynamo, DeepSpeed or FSDP, 4 GPUs in total, GPU ids, precision
    ]
    data = saved_yaml(run_accel(tmp_path, ["config", "--config_file", str(path)], answers), path)
    assert (data["distributed_type"], data["num_machines"], data["machine_rank"]) == ("MULTI_GPU", 2, 1)
    assert (data["main_process_ip"], data["main_process_port"]) == ("10.1.2.3", 29501)
    assert (data["same_network"], data["rdzv_backend"], data["debug"]) == (False, "c10d", True)
    assert (data["num_processes"], data["gpu_ids"], data["use_cpu"]) == (4, "0,1", False)


def test_invalid_answers_are_asked_again_with_the_allowed_values(tmp_path):
    path = tmp_path / "c.yaml"
    answers = [
        "1",
        "0",  # SageMaker is refused, then this machine
        "quantum",
        "multi-cpu",
        "many",
        "1",
        "maybe",
        "no",
        "no",
        "no",
        "0",
        "3",
        "fp12",
        "BF16",
    ]
    result = run_accel(tmp_path, ["config", "--config_file", str(path)], answers)
    data = saved_yaml(result, path)
    assert (data["distributed_type"], data["num_processes"], data["mixed_precision"]) == ("MULTI_CPU", 3, "bf16")
    out = result.stdout
    assert "Amazon SageMaker is not supported by accel yet" in out
    assert (
        "'quantum' is not one of the options; allowed: 0 (No distributed training), 1 (multi-CPU), 2 (multi-GPU), "
        "3 (multi-CPU with FSDP)"
    ) in out
    assert "'many' is not valid; allowed: an integer >= 1" in out
    assert "'maybe' is not a yes/no answer; allowed: y, yes, true, 1, n, no, false, 0" in out
    assert "'0' is not valid; allowed: an integer >= 1" in out
    assert "'fp12' is not one of the options; allowed: 0 (no), 1 (fp16), 2 (bf16), 3 (fp8)" in out


def launch_env(path: Path) -> dict[str, str]:
    """What `accel launch --config_file PATH` exports to the ranks."""
    return child_env(resolve({"config_file": str(path)}, environ={}), environ={})


def test_fsdp2_answers_are_saved_as_hf_writes_them_and_launch(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    answers = [
        "This machine",
        "multi-GPU",
        "1",
        "no",
        "no",
        "no",  # one machine, no debug, no dynamo, no DeepSpeed
        "yes",
        "",
        "",
        "no",  # FSDP, version 2, reshard after forward, no offload
        "SIZE_BASED_WRAP",
        "",
        "",
        "",
        "yes",  # 1e8 parameters, SHARDED_STATE_DICT, RAM-efficient loading, AC
        "no",  # no parallelism config
        "2",
        "bf16",  # no GPU ids for FSDP, as in HF
    ]
    data = saved_yaml(run_accel(tmp_path, ["config", "--config_file", str(path)], answers), path)
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"]) == ("FSDP", 2, False)
    assert "gpu_ids" not in data and "parallelism_config" not in data
    assert data["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": True,
        "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": 100000000,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": True,
    }
    env = launch_env(path)
    assert (env["ACCEL_USE_FSDP"], env["FSDP_VERSION"], env["FSDP_AUTO_WRAP_POLICY"]) == (
        "true",
        "2",
        "SIZE_BASED_WRAP",
    )
    assert (env["FSDP_ACTIVATION_CHECKPOINTING"], env["FSDP_STATE_DICT_TYPE"]) == ("true", "SHARDED_STATE_DICT")


def test_the_parallelism_config_answers_round_trip_to_the_launch(tmp_path):
    path = tmp_path / "hsdp.yaml"
    answers = [
        "This machine",
        "multi-CPU with FSDP",
        "1",
        "no",
        "no",
        "no",  # one machine, no debug, no IPEX, no dynamo
        "2",
        "",
        "",
        "NO_WRAP",
        "",
        "",
        "",  # FSDP2 with its defaults, no wrapping
        "yes",
        "2",
        "2",  # the parallelism config: 2 replicas of 2 shards (HSDP)
        "2",
        "1",  # tensor parallelism 2: refused, then 1
        "",  # no context parallelism, so no question on its strategy
        "4",
        "no",
    ]
    result = run_accel(tmp_path, ["config", "--config_file", str(path)], answers)
    data = saved_yaml(result, path)
    assert "tensor parallelism size 2 is not supported by accel: accel runs data parallelism only" in result.stdout
    assert "Do you want to use the parallelism config? [yes/NO]: " in result.stdout
    assert (data["distributed_type"], data["num_processes"]) == ("FSDP", 4)
    assert data["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
    }
    env = launch_env(path)
    assert (env["ACCEL_USE_PARALLELISM_CONFIG"], env["ACCELERATE_USE_PARALLELISM_CONFIG"]) == ("true", "true")
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")


def test_fsdp1_on_cpus_asks_again_for_what_fsdp2_cannot_do(tmp_path):
    path = tmp_path / "fsdp1.yaml"
    answers = [
        "0",
        "multi-CPU with FSDP",
        "1",
        "no",
        "no",
        "no",  # one machine, no debug, no IPEX, no dynamo
        "1",
        "SHARD_GRAD_OP",
        "",  # FSDP version 1, its sharding strategy, no offload
        "TRANSFORMER_BASED_WRAP",
        "no",
        "GPT2Block",
        "BACKWARD_POST",
        "0",  # refused, then BACKWARD_PRE
        "LOCAL_STATE_DICT",
        "FULL_STATE_DICT",  # refused, then FULL_STATE_DICT
        "yes",
        "no",  # forward prefetch: refused, then no
        "",
        "no",
        "",
        "",  # use_orig_params, no RAM-efficient loading so sync_module_states is asked, no checkpointing
        "2",
        "no",
    ]
    result = run_accel(tmp_path, ["config", "--config_file", str(path)], answers)
    data = saved_yaml(result, path)
    assert (data["distributed_type"], data["use_cpu"], data["num_processes"]) == ("FSDP", True, 2)
    assert data["fsdp_config"] == {
        "fsdp_version": 1,
        "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
        "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_forward_prefetch": False,
        "fsdp_use_orig_params": True,
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_sync_module_states": True,
        "fsdp_activation_checkpointing": False,
    }
    for refused in ("backward_prefetch BACKWARD_POST", "state_dict_type LOCAL_STATE_DICT", "forward_prefetch true"):
        assert f"{refused} is not supported by accel: accel runs FSDP1 options on FSDP2" in result.stdout
    env = launch_env(path)
    assert (env["ACCEL_USE_CPU"], env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"]) == ("true", "2", "false")
    assert (env["FSDP_TRANSFORMER_CLS_TO_WRAP"], env["FSDP_STATE_DICT_TYPE"]) == ("GPT2Block", "FULL_STATE_DICT")
    assert "FSDP_BACKWARD_PREFETCH" not in env


def test_stdin_closing_early_exits_non_zero_and_saves_nothing(tmp_path):
    result = run_accel(tmp_path, ["config"], ["This machine", "multi-CPU"])
    assert result.returncode == 1
    assert "stdin closed before this question was answered" in result.stderr
    assert "How many different machines will you use" in result.stderr
    assert "Nothing was saved" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "default_config.yaml").exists()


# --- accel config default --------------------------------------------------------------------------------


def test_config_default_writes_yaml_and_keeps_an_existing_file(tmp_path):
    assert ACCEL_SCRIPT.exists(), f"the `accel` console script is not installed next to {sys.executable}"
    path = tmp_path / "basic.yaml"
    first = run_accel(
        tmp_path, ["config", "default", "--mixed_precision", "bf16", "--config_file", str(path)], script=True
    )
    data = saved_yaml(first, path)
    assert not path.read_text().lstrip().startswith("{")  # YAML, not HF's JSON-in-a-.yaml
    assert data["mixed_precision"] == "bf16" and data["distributed_type"] in ("NO", "MULTI_GPU")

    before = path.read_text()
    second = run_accel(tmp_path, ["config", "default", "--config_file", str(path)], script=True)
    assert second.returncode == 0  # HF Accelerate also exits 0 here
    assert f"Configuration already exists at {path}, will not override" in second.stdout
    assert "--force" in second.stdout and path.read_text() == before

    forced = run_accel(tmp_path, ["config", "default", "--force", "--config_file", str(path)], script=True)
    assert saved_yaml(forced, path)["mixed_precision"] == "no"


# --- the answer parsers, in process ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("y", True),
        ("YES", True),
        ("true", True),
        ("1", True),
        ("n", False),
        ("No", False),
        ("FALSE", False),
        ("0", False),
    ],
)
def test_yes_no_spellings(answer, expected):
    assert parse_yes_no(answer) is expected


@pytest.mark.parametrize("answer", ["2", "multi-GPU", "MULTI-gpu", "multi_gpu"])
def test_options_are_picked_by_number_label_or_stored_value(answer):
    assert pick_option(answer, MACHINE_TYPE_OPTIONS) == "MULTI_GPU"


@pytest.mark.parametrize("answer", ["4", "-1", "gpu", ""])
def test_unknown_options_list_the_allowed_ones(answer):
    with pytest.raises(ValueError, match=r"allowed: 0 \(No distributed training\), 1 \(multi-CPU\), 2 \(multi-GPU\)"):
        pick_option(answer, MACHINE_TYPE_OPTIONS)


def test_integer_answers_are_range_checked():
    parse = integer_between(2, 8, multiple_of=2)
    assert parse("4") == 4
    for answer in ("3", "10", "0", "four", "4.0"):
        with pytest.raises(ValueError, match="allowed: an integer from 2 to 8 that is a multiple of 2"):
            parse(answer)
