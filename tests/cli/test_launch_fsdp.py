"""FSDP at `accel launch`: flags, config file and FSDP_* variables become the environment HF's launcher exports
(checked against HF Accelerate's own launcher where it is installed), fsdp_version 1 runs on FSDP2 through the rule
`accel to-fsdp2` applies, and what FSDP2 cannot do is refused naming who asked. No training: the environment a
launch exports is what is checked (one real launch shows it reaches the ranks)."""

import json
import os
import textwrap

import pytest
import yaml

from accel.backends import fsdp_options
from accel.cli.config_file import ConfigError, load_config
from accel.cli.launch import (
    LaunchConfig,
    LaunchError,
    child_env,
    dropped_variables,
    flags_from_args,
    fsdp_line,
    resolve,
    torchrun_argv,
)
from accel.cli.main import build_parser, main
from accel.unsupported import UnsupportedFeatureError

# Every FSDP flag of HF Accelerate 1.15, each set away from its default, with fsdp_version 2 (passed through as is).
EVERY_FLAG = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_offload_params",
    "true",
    "--fsdp_min_num_params",
    "2000",
    "--fsdp_sharding_strategy",
    "SHARD_GRAD_OP",
    "--fsdp_reshard_after_forward",
    "false",
    "--fsdp_auto_wrap_policy",
    "SIZE_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "BertLayer,BertEmbeddings",
    "--fsdp_backward_prefetch",
    "BACKWARD_POST",
    "--fsdp_state_dict_type",
    "FULL_STATE_DICT",
    "--fsdp_forward_prefetch",
    "true",
    "--fsdp_use_orig_params",
    "false",
    "--fsdp_cpu_ram_efficient_loading",
    "false",
    "--fsdp_sync_module_states",
    "false",
    "--fsdp_activation_checkpointing",
    "true",
    "--fsdp_activation_checkpointing_offload",
    "true",
]
EVERY_FLAG_ENV = {
    "ACCEL_USE_FSDP": "true",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_OFFLOAD_PARAMS": "true",
    "FSDP_MIN_NUM_PARAMS": "2000",
    "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP",
    "FSDP_RESHARD_AFTER_FORWARD": "false",
    "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer,BertEmbeddings",
    "FSDP_BACKWARD_PREFETCH": "BACKWARD_POST",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_FORWARD_PREFETCH": "true",
    "FSDP_USE_ORIG_PARAMS": "false",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_SYNC_MODULE_STATES": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true",
}
# HF's launch defaults, exported for a bare `--use_fsdp --fsdp_version 2`.
DEFAULT_ENV = {
    "ACCEL_USE_FSDP": "true",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}

# What HF Accelerate 1.15 writes for FSDP1 and FSDP2 (its ClusterConfig.to_yaml_file, its questionnaire's keys).
HF_FSDP1 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: FULL_SHARD
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
HF_FSDP2 = HF_FSDP1.replace(
    """\
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: FULL_SHARD
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
""",
    """\
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_min_num_params: 100000000
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
""",
)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def resolved(*argv, environ=None):
    return resolve(flags_from_args(build_parser().parse_args(["launch", *argv, "train.py"])), environ=environ or {})


def fsdp_env(config, environ=None):
    """The FSDP variables (and ACCEL_USE_FSDP) the launch exports to every rank."""
    return {name: value for name, value in child_env(config, environ=environ or {}).items() if "FSDP" in name}


def hf_fsdp_env(*argv):
    """The FSDP variables HF Accelerate's own launcher exports for `accelerate launch ARGV train.py`."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    fixed = [
        "--num_processes",
        "2",
        "--main_process_port",
        "29511",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    args = launch_command_parser().parse_args([*argv, *fixed, "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {name: value for name, value in env.items() if "FSDP" in name and name not in os.environ}


# --- flags, config file and variables -> the ranks' environment ----------------------------------------------


def test_every_hf_fsdp_flag_reaches_the_ranks_under_hfs_variable():
    assert fsdp_env(resolved(*EVERY_FLAG)) == EVERY_FLAG_ENV
    assert fsdp_env(resolved("--use_fsdp", "--fsdp_version", "2")) == DEFAULT_ENV
    # Every option of the table is a flag here, except fsdp_ignored_modules (config file only, as in HF).
    assert {flag.lstrip("-") for flag in EVERY_FLAG if flag.startswith("--fsdp_")} == set(fsdp_options.OPTIONS) - {
        "fsdp_ignored_modules"
    }


@pytest.mark.parametrize("argv", [EVERY_FLAG, ["--use_fsdp", "--fsdp_version", "2"]], ids=["every flag", "defaults"])
def test_fsdp2_flags_export_what_hf_accelerates_launcher_exports(argv):
    expected = {"ACCEL_USE_FSDP": "true", **hf_fsdp_env(*argv)}
    assert fsdp_env(resolved(*argv)) == expected


def test_an_hf_fsdp2_config_file_exports_what_hf_accelerates_launcher_exports(tmp_path):
    path = write(tmp_path / "fsdp2.yaml", HF_FSDP2)
    assert fsdp_env(resolved("--config_file", str(path))) == {
        "ACCEL_USE_FSDP": "true",
        **hf_fsdp_env("--config_file", str(path)),
    }


def test_config_file_keys_with_and_without_prefix_and_ignored_modules(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """\
        distributed_type: FSDP
        fsdp_config:
          version: 2
          fsdp_offload_params: true
          transformer_layer_cls_to_wrap: [GPT2Block, GPT2MLP]
          fsdp_auto_wrap_policy: transformer_based_wrap
          fsdp_ignored_modules: "lm_head"
    """,
    )
    env = fsdp_env(resolved("--config_file", str(path)))
    assert (env["FSDP_VERSION"], env["FSDP_OFFLOAD_PARAMS"], env["FSDP_IGNORED_MODULES"]) == ("2", "true", "lm_head")
    assert (env["FSDP_TRANSFORMER_CLS_TO_WRAP"], env["FSDP_AUTO_WRAP_POLICY"]) == (
        "GPT2Block,GPT2MLP",
        "TRANSFORMER_BASED_WRAP",
    )  # a list is joined; HF would pass its repr


def test_precedence_config_file_then_variables_then_flags(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """\
        distributed_type: FSDP
        fsdp_config: {fsdp_version: 2, fsdp_offload_params: false, fsdp_state_dict_type: FULL_STATE_DICT}
    """,
    )
    environ = {"FSDP_OFFLOAD_PARAMS": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}
    env = fsdp_env(resolved("--config_file", str(path), "--fsdp_state_dict_type", "FULL_STATE_DICT", environ=environ))
    assert (env["FSDP_OFFLOAD_PARAMS"], env["FSDP_STATE_DICT_TYPE"]) == ("true", "FULL_STATE_DICT")
    assert fsdp_env(resolved("--config_file", str(path)))["FSDP_OFFLOAD_PARAMS"] == "false"


@pytest.mark.parametrize("name", ["ACCEL_USE_FSDP", "ACCELERATE_USE_FSDP"])
def test_the_fsdp_switch_is_read_from_accels_and_hfs_variable(name):
    config = resolved("--cpu", environ={name: "true", "FSDP_VERSION": "2"})
    assert config.use_fsdp and fsdp_env(config)["ACCELERATE_USE_FSDP"] == "true"
    off = resolved("--cpu", environ={"ACCEL_USE_FSDP": "false", "ACCELERATE_USE_FSDP": "true"})
    assert not off.use_fsdp  # accel's spelling wins, as everywhere


def test_multi_gpu_over_an_fsdp_config_runs_ddp_as_in_hf_and_cpu_keeps_fsdp(tmp_path):
    path = write(tmp_path / "c.yaml", "distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\nnum_processes: 2\n")
    ddp = resolved("--config_file", str(path), "--multi_gpu", environ={"ACCELERATE_USE_FSDP": "true"})
    assert not ddp.use_fsdp
    # The ranks follow the launcher, not an inherited ACCELERATE_USE_FSDP=true.
    assert fsdp_env(ddp, environ={"ACCELERATE_USE_FSDP": "true"}) == {
        "ACCEL_USE_FSDP": "false",
        "ACCELERATE_USE_FSDP": "false",
    }
    on_cpu = resolved("--config_file", str(path), "--cpu")
    assert on_cpu.use_fsdp and on_cpu.use_cpu
    assert resolved("--config_file", str(path), "--multi_gpu", "--use_fsdp").use_fsdp


def test_cpu_use_fsdp_runs_fsdp_on_cpu_processes(tmp_path):
    config = resolved("--cpu", "--use_fsdp", "--fsdp_version", "2", "--num_processes", "2")
    env = child_env(config, environ={})
    assert env["ACCEL_USE_CPU"] == "true" and env["ACCEL_USE_FSDP"] == env["ACCELERATE_USE_FSDP"] == "true"
    argv = torchrun_argv(config)
    assert argv[argv.index("--nproc_per_node") + 1] == "2"
    path = write(tmp_path / "c.yaml", "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\n")
    from_file = resolved("--config_file", str(path))
    assert from_file.use_fsdp and from_file.use_cpu and not from_file.multi_gpu


def test_without_fsdp_nothing_of_it_is_exported():
    assert fsdp_env(resolved("--cpu")) == {"ACCEL_USE_FSDP": "false"}
    assert [name for name in dropped_variables(resolved("--cpu"), {}) if "FSDP" in name] == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fsdp_offload_params", "true"], "--fsdp_offload_params has no effect without FSDP: add --use_fsdp"),
        (["--multi_gpu", "--num_processes", "2", "--fsdp_version", "2"], "--fsdp_version has no effect without FSDP"),
        (
            ["--use_fsdp", "--fsdp_offload_params", "maybe"],
            "--fsdp_offload_params: 'maybe' is not valid; expected true or",
        ),
        (
            ["--use_fsdp", "--fsdp_auto_wrap_policy", "BY_SIZE"],
            "allowed values: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP",
        ),
        (
            ["--use_fsdp", "--fsdp_sync_module_states", "false"],
            "--fsdp_sync_module_states false: fsdp_cpu_ram_efficient_loading (true unless set to false) needs "
            "fsdp_sync_module_states true",
        ),
        (
            ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_reshard_after_forward", "true"],
            "--fsdp_sharding_strategy SHARD_GRAD_OP and --fsdp_reshard_after_forward true disagree: "
            "SHARD_GRAD_OP means reshard_after_forward false",
        ),
    ],
)
def test_bad_fsdp_settings_name_the_flag(argv, message, capsys):
    assert main(["launch", *argv, "train.py"]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_fsdp_variable_or_key_names_it(tmp_path):
    with pytest.raises(LaunchError, match="FSDP_MIN_NUM_PARAMS: 'many' is not valid; expected an integer >= 0"):
        resolved("--use_fsdp", environ={"FSDP_MIN_NUM_PARAMS": "many"})
    path = write(tmp_path / "c.yaml", "distributed_type: FSDP\nfsdp_config: {fsdp_verison: 2}\n")
    with pytest.raises(
        ConfigError,
        match=r"fsdp_config.fsdp_verison: 2 is not valid; unknown key \(did you mean "
        r"'fsdp_version'\?\)",
    ):
        resolved("--config_file", str(path))


# --- fsdp_version 1 on FSDP2 ---------------------------------------------------------------------------------


def test_fsdp1_defaults_run_on_fsdp2_saying_so():
    config = resolved("--cpu", "--use_fsdp")
    env = fsdp_env(config)
    assert env == {**DEFAULT_ENV, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}  # FSDP1's format, kept
    assert fsdp_line(config) == (
        "accel launch: fsdp_version 1 options run on FSDP2: FULL_SHARD (FSDP1's default) → reshard_after_forward "
        "true; state_dict_type FULL_STATE_DICT (FSDP1's default; FSDP2's is SHARDED_STATE_DICT)"
    )
    assert fsdp_line(resolved("--cpu", "--use_fsdp", "--fsdp_version", "2")) is None


@pytest.mark.parametrize("strategy,reshard", [("FULL_SHARD", "true"), ("SHARD_GRAD_OP", "false"), ("2", "false")])
def test_each_sharding_strategy_becomes_reshard_after_forward(strategy, reshard):
    for argv in (["--fsdp_sharding_strategy", strategy], ["--fsdp_reshard_after_forward", strategy]):
        config = resolved("--use_fsdp", "--fsdp_version", "1", *argv)
        env = fsdp_env(config)
        assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"]) == ("2", reshard)
        assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"
        assert f"→ reshard_after_forward {reshard}" in fsdp_line(config)


@pytest.mark.parametrize(
    "strategy,reshard", [("HYBRID_SHARD", "true"), ("HYBRID_SHARD_ZERO2", "false"), ("NO_SHARD", "false")]
)
def test_strategies_on_a_2d_mesh_are_exported_for_the_ranks_to_build_it(strategy, reshard, monkeypatch):
    config = resolved("--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", strategy)
    env = fsdp_env(config)
    assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"], env["FSDP_SHARDING_STRATEGY"]) == (
        "2",
        reshard,
        strategy,
    )
    assert ("replicate-only mesh" if strategy == "NO_SHARD" else "2-D mesh") in fsdp_line(config)
    # The ranks' plugin (FSDP2, from these variables) carries the strategy for the mesh; FSDP2 reads no other.
    from accel.backends.fsdp import FullyShardedDataParallelPlugin
    from accel.strategies.fsdp2 import fsdp2_plugin

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugin, mesh_strategy = fsdp2_plugin(FullyShardedDataParallelPlugin())
    assert (plugin.fsdp_version, plugin.reshard_after_forward, mesh_strategy) == (2, reshard == "true", strategy)
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    assert fsdp2_plugin(FullyShardedDataParallelPlugin())[1] is None


def test_hf_fsdp1_defaults_translate_and_the_others_are_said(tmp_path):
    config = resolved("--config_file", str(write(tmp_path / "fsdp1.yaml", HF_FSDP1)))
    env = fsdp_env(config)
    assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"], env["FSDP_STATE_DICT_TYPE"]) == (
        "2",
        "true",
        "FULL_STATE_DICT",
    )
    dropped = [name for name in dropped_variables(config, child_env(config, environ={})) if "FSDP" in name]
    assert "FSDP_BACKWARD_PREFETCH" not in env and dropped == [
        "FSDP_BACKWARD_PREFETCH",
        "FSDP_IGNORED_MODULES",
    ]  # an inherited one would contradict the translation
    assert fsdp_line(config) == (
        "accel launch: fsdp_version 1 options run on FSDP2: FULL_SHARD → reshard_after_forward true; backward_prefetch "
        "BACKWARD_PRE → FSDP2's own prefetching (the next all-gather before each backward)"
    )
    line = fsdp_line(resolved("--use_fsdp", "--fsdp_use_orig_params", "false"))
    assert "use_orig_params false → FSDP2 always uses the original parameters" in line


@pytest.mark.parametrize(
    "option,value",
    [
        ("fsdp_backward_prefetch", "BACKWARD_POST"),
        ("fsdp_backward_prefetch", "NO_PREFETCH"),
        ("fsdp_forward_prefetch", "true"),
        ("fsdp_state_dict_type", "LOCAL_STATE_DICT"),
    ],
)
def test_fsdp1_options_fsdp2_cannot_honour_are_refused_naming_who_asked(tmp_path, option, value):
    variable = fsdp_options.OPTIONS[option].variable
    path = write(tmp_path / "c.yaml", f"distributed_type: FSDP\nfsdp_config:\n  {option}: {value}\n")
    for argv, environ, asked_by in (
        (["--use_fsdp", f"--{option}", value], {}, f"--{option} {value}"),
        (["--use_fsdp"], {variable: value}, f"{variable}={value}"),
        (["--config_file", str(path)], {}, f"{path}: fsdp_config.{option}: {value}"),
    ):
        with pytest.raises(UnsupportedFeatureError) as error:
            resolved(*argv, environ=environ)
        assert error.value.asked_by == asked_by and "accel runs FSDP1 options on FSDP2" in error.value.instead
    # With fsdp_version 2 they pass through as HF's launcher passes them (its plugin says what it ignores).
    assert fsdp_env(resolved("--use_fsdp", "--fsdp_version", "2", f"--{option}", value))[variable] == value


def test_a_refused_fsdp1_option_exits_2_before_anything_starts(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    assert main(["launch", "--cpu", "--use_fsdp", "--fsdp_backward_prefetch", "NO_PREFETCH", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "accel launch: error: FSDP1's backward_prefetch NO_PREFETCH is not supported by accel "
        "(asked for by --fsdp_backward_prefetch NO_PREFETCH)"
    )
    assert not marker.exists()


# --- HF's files, `accel config update` and `accel to-fsdp2` --------------------------------------------------


@pytest.mark.parametrize("text", [HF_FSDP1, HF_FSDP2], ids=["fsdp1", "fsdp2"])
def test_hf_fsdp_config_files_load_and_round_trip_unchanged(tmp_path, text):
    path = write(tmp_path / "default_config.yaml", text)
    config = load_config(path)
    config.check_supported()
    assert config.to_dict() == yaml.safe_load(text)
    assert main(["config", "update", "--config_file", str(path)]) == 0
    assert path.read_text() == text


def test_old_and_prefixless_fsdp_keys_load_and_are_checked(tmp_path):
    old = write(
        tmp_path / "old.yaml",
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_backward_prefetch_policy: BACKWARD_PRE\n  sharding_strategy: 1\n",
    )
    assert load_config(old).fsdp_config == {"fsdp_backward_prefetch_policy": "BACKWARD_PRE", "sharding_strategy": 1}
    assert "backward_prefetch BACKWARD_PRE → FSDP2's own" in fsdp_line(resolved("--config_file", str(old)))
    bad = write(tmp_path / "bad.yaml", "distributed_type: FSDP\nfsdp_config: {fsdp_state_dict_type: PICKLE}\n")
    with pytest.raises(
        ConfigError,
        match="fsdp_config.fsdp_state_dict_type: 'PICKLE' is not valid; allowed values: "
        "FULL_STATE_DICT, LOCAL_STATE_DICT, SHARDED_STATE_DICT",
    ):
        load_config(bad)


def test_to_fsdp2_keeps_what_fsdp1_meant_and_refuses_what_fsdp2_cannot_do(tmp_path, capsys):
    source = write(
        tmp_path / "hybrid.yaml",
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_use_orig_params: false\n",
    )
    output = tmp_path / "out.yaml"
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(output)]) == 0
    assert yaml.safe_load(output.read_text())["fsdp_config"] == {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": True,
        "fsdp_sharding_strategy": "HYBRID_SHARD",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
    }
    refused = write(
        tmp_path / "post.yaml", "distributed_type: FSDP\nfsdp_config: {fsdp_backward_prefetch: BACKWARD_POST}\n"
    )
    assert main(["to-fsdp2", "--config_file", str(refused), "--output_file", str(tmp_path / "no.yaml")]) == 2
    assert (
        f"asked for by {refused}: fsdp_config.fsdp_backward_prefetch: BACKWARD_POST" in capsys.readouterr().err
    ) and not (tmp_path / "no.yaml").exists()


# --- HF's launch helpers ---------------------------------------------------------------------------------------


def test_prepare_multi_gpu_env_exports_fsdp_and_reads_hfs_defaults_as_unset():
    import accel.utils
    from accel.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(["--num_processes", "2", "train.py"])
    args.use_fsdp, args.fsdp_sharding_strategy = True, "SHARD_GRAD_OP"  # with HF's default reshard "true"
    env = accel.utils.prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == env["ACCEL_USE_FSDP"] == "true"
    assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"]) == ("2", "false")


# --- a real launch -------------------------------------------------------------------------------------------

ENV_SCRIPT = """
    import json, os
    seen = {name: value for name, value in os.environ.items() if "FSDP" in name}
    os.write(1, ("rank " + os.environ["RANK"] + " " + json.dumps(seen, sort_keys=True) + "\\n").encode())
"""


@pytest.mark.slow
def test_the_ranks_see_the_translated_environment(tmp_path):
    from test_launch import accel, isolated_env

    script = write(tmp_path / "env.py", ENV_SCRIPT)
    env = isolated_env(tmp_path, FSDP_BACKWARD_PREFETCH="BACKWARD_PRE")  # read by the launcher, dropped for FSDP2
    result = accel(
        tmp_path,
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--use_fsdp",
        "--fsdp_sharding_strategy",
        "SHARD_GRAD_OP",
        str(script),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "accel launch: fsdp_version 1 options run on FSDP2: SHARD_GRAD_OP → reshard_after_forward false; "
        "backward_prefetch BACKWARD_PRE → FSDP2's own prefetching"
    ) in result.stderr
    seen = sorted(line.split(" ", 2)[1:] for line in result.stdout.splitlines() if line.startswith("rank"))
    assert [rank for rank, _ in seen] == ["0", "1"]
    expected = fsdp_env(
        LaunchConfig(
            use_cpu=True, use_fsdp=True, fsdp_sharding_strategy="SHARD_GRAD_OP", fsdp_backward_prefetch="BACKWARD_PRE"
        )
    )
    assert all(json.loads(variables) == expected for _, variables in seen)
