"""`accel launch --use_parallelism_config`: HF's flags, config file key and variables reach the ranks as HF's launcher
exports them; sizes beyond data parallelism and settings that cannot run are refused before anything starts."""

import argparse

import pytest
from test_launch_fsdp import resolved, write

from accel.cli import parallelism_options
from accel.cli.launch import LaunchError, child_env, dropped_variables
from accel.cli.launch_env import prepare_multi_gpu_env
from accel.cli.main import build_parser, main
from accel.unsupported import UnsupportedFeatureError

FSDP2 = ("--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_version", "2")
SHARDED = (*FSDP2, "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2")
# What every rank sees for SHARDED: HF's variables (HF's launch defaults for the options not given).
SHARDED_ENV = {
    "ACCEL_USE_PARALLELISM_CONFIG": "true",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    "PARALLELISM_CONFIG_TP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_BACKEND": "torch",
    "PARALLELISM_CONFIG_SP_SIZE": "1",
    "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
}
FSDP2_FILE = """
    distributed_type: FSDP
    num_processes: 4
    use_cpu: true
    fsdp_config:
      fsdp_version: 2
"""


def parallelism_env(config, environ=None):
    """The parallelism variables the launch exports to every rank."""
    return {name: value for name, value in child_env(config, environ=environ or {}).items() if "PARALLELISM" in name}


def hf_parser_args(*argv):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args([*argv, "train.py"])


# --- flags, config file and variables -> the ranks' environment ----------------------------------------------


def test_flags_export_what_hf_accelerates_launcher_exports():
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command
    from accelerate.utils.launch import prepare_multi_gpu_env as hf_prepare_multi_gpu_env

    argv = ("--use_parallelism_config", "--parallelism_config_dp_replicate_size", "2")
    argv += ("--parallelism_config_dp_shard_size", "2", "--parallelism_config_cp_comm_strategy", "alltoall")
    fixed = ("--num_processes", "4", "--main_process_port", "29511", "--mixed_precision", "no")
    args, _, _ = _validate_launch_command(hf_parser_args("--use_fsdp", "--fsdp_version", "2", *argv, *fixed))
    hf = {name: value for name, value in hf_prepare_multi_gpu_env(args).items() if "PARALLELISM" in name}
    ours = parallelism_env(resolved("--cpu", "--use_fsdp", "--fsdp_version", "2", *argv, *fixed))
    assert ours == {**hf, "ACCEL_USE_PARALLELISM_CONFIG": "true"}
    assert ours["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2" and "PARALLELISM_CONFIG_CP_COMM_STRATEGY" not in ours


@pytest.mark.parametrize(
    "argv",
    [
        ("--parallelism_config_cp_size", "2", "--parallelism_config_cp_comm_strategy", "alltoall"),
        ("--parallelism_config_sp_size", "2", "--parallelism_config_sp_attn_implementation", "flash_attention_2"),
        ("--parallelism_config_sp_size", "2", "--parallelism_config_sp_seq_length", "128"),
    ],
)
def test_the_variables_of_context_and_sequence_parallelism_are_written_as_hf_writes_them(argv):
    # The launch refuses these sizes; the table still writes what HF's launcher would, for when they run.
    args = hf_parser_args("--use_parallelism_config", *argv)
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    ours = build_parser().parse_args(["launch", *argv, "train.py"])
    given = {key: parallelism_options.parse_entry(key, getattr(ours, key)) for key in ours.nondefault}
    assert parallelism_options.environment(given) == prepare_extend_env_parallelism_config(args, {})


def test_the_e2e_command_exports_hfs_variables_and_nothing_is_dropped_that_it_sets():
    config = resolved(*SHARDED)
    env = child_env(config, environ={})
    assert parallelism_env(config) == SHARDED_ENV
    assert [name for name in dropped_variables(config, env) if "PARALLELISM" in name] == [
        "PARALLELISM_CONFIG_CP_COMM_STRATEGY",
        "PARALLELISM_CONFIG_SP_SEQ_LENGTH",
        "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE",
        "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION",
    ]  # an inherited one is not what this launch asked for


def test_a_config_file_turns_it_on_and_flags_override_its_keys(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        FSDP2_FILE + "    parallelism_config:\n      parallelism_config_dp_replicate_size: 2\n"
        "      parallelism_config_dp_shard_size: 2\n",
    )
    config = resolved("--config_file", str(path))
    assert config.use_parallelism_config and config.use_cpu and config.num_processes == 4
    env = parallelism_env(config)
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")
    flipped = resolved(
        "--config_file",
        str(path),
        "--parallelism_config_dp_replicate_size",
        "1",
        "--parallelism_config_dp_shard_size",
        "4",
    )
    assert (flipped.parallelism_config_dp_replicate_size, flipped.parallelism_config_dp_shard_size) == (1, 4)


def test_as_in_hf_a_backend_flag_turns_off_the_files_parallelism_config(tmp_path):
    path = write(
        tmp_path / "c.yaml", FSDP2_FILE + "    parallelism_config:\n      parallelism_config_dp_shard_size: 4\n"
    )
    assert not resolved("--config_file", str(path), "--use_fsdp").use_parallelism_config
    assert resolved("--config_file", str(path), "--use_fsdp", "--use_parallelism_config").use_parallelism_config
    assert not resolved("--config_file", str(path), "--multi_gpu").use_parallelism_config  # DDP: nothing to refuse
    assert resolved("--config_file", str(path), "--cpu").use_parallelism_config  # --cpu keeps FSDP, as in HF


@pytest.mark.parametrize("switch", ["ACCEL_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_PARALLELISM_CONFIG"])
def test_the_variables_are_a_layer_below_the_flags(switch):
    environ = {
        switch: "true",
        "ACCEL_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "ACCEL_NUM_PROCESSES": "4",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    }
    config = resolved("--cpu", environ=environ)
    assert config.use_parallelism_config
    assert (config.parallelism_config_dp_replicate_size, config.parallelism_config_dp_shard_size) == (2, 2)
    shards = ("--parallelism_config_dp_shard_size", "4")
    over = resolved("--cpu", "--parallelism_config_dp_replicate_size", "1", *shards, environ=environ)
    env = parallelism_env(over)
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("1", "4")
    with pytest.raises(LaunchError, match="make 8 processes but ACCEL_NUM_PROCESSES=4 asks for 4"):
        resolved("--cpu", *shards, environ=environ)


def test_without_it_the_ranks_are_told_no_and_inherited_variables_are_dropped():
    inherited = {"ACCELERATE_USE_PARALLELISM_CONFIG": "false", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    config = resolved("--cpu", environ=inherited)  # TP_SIZE is read, but nothing uses it
    assert parallelism_env(config) == {"ACCEL_USE_PARALLELISM_CONFIG": "false"}
    assert parallelism_env(config, inherited) == {
        "ACCEL_USE_PARALLELISM_CONFIG": "false",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "false",
    }
    assert set(parallelism_options.VARIABLES) <= set(dropped_variables(config, child_env(config, environ={})))


# --- what is refused, and the words --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ("--cpu", "--use_parallelism_config"),
            "--use_parallelism_config: You cannot use `--use_parallelism_config` without `--use_fsdp` and "
            "`--fsdp_version=2`; FSDP is off",
        ),
        (("--use_fsdp", "--use_parallelism_config"), "; fsdp_version is unset (HF's default: 1)"),
        (("--use_fsdp", "--fsdp_version", "1", "--use_parallelism_config"), "; --fsdp_version 1 asks for FSDP1"),
        (
            ("--cpu", "--parallelism_config_dp_shard_size", "2"),
            "--parallelism_config_dp_shard_size has no effect without --use_parallelism_config",
        ),
        (
            (*FSDP2, "--use_parallelism_config"),
            "the parallelism config's sizes (dp_replicate × dp_shard × tp × cp × sp, unset ones 1) make 1 processes "
            "but --num_processes 2 asks for 2: they must be equal",
        ),
        ((*SHARDED, "--parallelism_config_dp_replicate_size", "2"), "make 4 processes but --num_processes 2"),
        ((*SHARDED, "--parallelism_config_cp_comm_strategy", "ring"), "allowed values: allgather, alltoall"),
    ],
)
def test_settings_that_cannot_run_are_errors_naming_the_setting(argv, message):
    with pytest.raises(LaunchError) as error:
        resolved(*argv)
    assert message in str(error.value)


def test_fsdp_version_1_from_the_file_is_named(tmp_path):
    path = write(tmp_path / "c.yaml", FSDP2_FILE.replace("fsdp_version: 2", "fsdp_version: 1"))
    with pytest.raises(LaunchError, match=f"; {path}: fsdp_config.fsdp_version: 1 asks for FSDP1"):
        resolved("--config_file", str(path), "--use_fsdp", "--use_parallelism_config")


@pytest.mark.parametrize(
    "size,feature",
    [("tp_size", "Tensor"), ("cp_size", "context"), ("sp_size", "sequence")],
)
@pytest.mark.parametrize("layer", ["flag", "env", "config"])
def test_sizes_beyond_data_parallelism_are_refused_naming_who_asked(tmp_path, size, feature, layer):
    key = f"parallelism_config_{size}"
    path = write(tmp_path / "c.yaml", FSDP2_FILE + f"    parallelism_config:\n      {key}: 2\n")
    argv, environ, asked_by = {
        "flag": ((*FSDP2, "--use_parallelism_config", f"--{key}", "2"), {}, f"--{key} 2"),
        "env": (
            (*FSDP2, "--use_parallelism_config"),
            {f"PARALLELISM_CONFIG_{size.upper()}": "2"},
            f"PARALLELISM_CONFIG_{size.upper()}=2",
        ),
        "config": (("--config_file", str(path)), {}, f"{path}: parallelism_config.{key}: 2"),
    }[layer]
    with pytest.raises(UnsupportedFeatureError) as error:
        resolved(*argv, environ=environ)
    assert error.value.asked_by == asked_by and error.value.instead
    assert f"{feature}" in error.value.feature and size in error.value.feature


def test_a_refused_size_exits_2_before_anything_starts(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    assert main(["launch", *SHARDED, "--parallelism_config_tp_size", "2", str(script)]) == 2
    assert "(asked for by --parallelism_config_tp_size 2)" in capsys.readouterr().err
    assert main(["launch", "--cpu", "--use_parallelism_config", str(script)]) == 2
    assert "without `--use_fsdp`" in capsys.readouterr().err
    assert not marker.exists()


# --- HF's helpers ------------------------------------------------------------------------------------------


def test_prepare_multi_gpu_env_exports_it_and_refuses_what_accel_launch_refuses():
    args = hf_parser_args(*SHARDED)
    env = prepare_multi_gpu_env(argparse.Namespace(**vars(args)))
    assert {name: env[name] for name in SHARDED_ENV} == SHARDED_ENV
    with pytest.raises(UnsupportedFeatureError, match=r"asked for by args.parallelism_config_tp_size=2\)"):
        prepare_multi_gpu_env(hf_parser_args(*SHARDED, "--parallelism_config_tp_size", "2"))
    with pytest.raises(LaunchError, match="args.use_parallelism_config: You cannot use"):
        prepare_multi_gpu_env(hf_parser_args("--cpu", "--num_processes", "2", "--use_parallelism_config"))


# --- a real launch --------------------------------------------------------------------------------------------

SHARDED_SCRIPT = """
    import os
    import torch
    from torch.distributed.tensor import DTensor
    from accel import Accelerator

    accelerator = Accelerator()
    assert accelerator.parallelism_config.dp_shard_size == 2, accelerator.parallelism_config
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = model.weight.full_tensor().clone()
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    weight = model.weight
    assert isinstance(weight, DTensor) and weight.device_mesh.size() == 2 and weight.placements[0].is_shard()
    assert weight.to_local().shape == (2, 4) and not torch.equal(weight.full_tensor(), before)
    os.write(1, f"rank {accelerator.process_index} sharded {tuple(weight.to_local().shape)}\\n".encode())
    accelerator.wait_for_everyone()
    accelerator.state.destroy_process_group()
"""


@pytest.mark.slow
def test_a_launch_with_dp_shard_size_2_shards_the_model_over_both_ranks(tmp_path):
    from test_launch import accel

    script = write(tmp_path / "sharded.py", SHARDED_SCRIPT)
    result = accel(tmp_path, "launch", *SHARDED, str(script), timeout=60)
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 sharded (2, 4)", "rank 1 sharded (2, 4)"]
