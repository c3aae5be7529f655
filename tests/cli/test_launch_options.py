"""`accel launch` parses every `accelerate launch` option: spellings, short forms, HF's defaults, what each one does
to the resolved LaunchConfig and torchrun's arguments, and one clear refusal for every backend accel does not run."""

import json
import os
import pathlib
import textwrap

import pytest

from accel.cli.launch import LaunchConfig, LaunchError, child_env, flags_from_args, resolve, torchrun_argv
from accel.cli.main import build_parser, main
from accel.unsupported import UnsupportedFeatureError

SURFACE = json.loads((pathlib.Path(__file__).parents[1] / "conformance" / "hf_accelerate_surface.json").read_text())


def launch_parser():
    return build_parser()._subparsers._group_actions[0].choices["launch"]


def parse(*argv):
    return build_parser().parse_args(["launch", *argv, "train.py"])


def resolved(*argv, environ=None):
    return resolve(flags_from_args(parse(*argv)), environ=environ or {})


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


# --- parsing: names, spellings, defaults ----------------------------------------------------------------------


def test_every_hf_option_has_both_spellings():
    options = launch_parser()._option_string_actions
    dashed = [name.replace("_", "-") for name in SURFACE["launch_options"] if "_" in name[2:]]
    assert [name for name in SURFACE["launch_options"] + dashed if name not in options] == []
    assert {"-t", "-q", "-m"} <= set(options)


def test_defaults_are_hf_accelerates():
    args = parse()
    expected = {
        "config_file": None,
        "quiet": False,
        "cpu": False,
        "multi_gpu": False,
        "tpu": False,
        "mixed_precision": None,
        "num_processes": None,
        "num_machines": None,
        "enable_cpu_affinity": False,
        "dynamo_backend": None,
        "dynamo_mode": "default",
        "gpu_ids": None,
        "same_network": False,
        "machine_rank": None,
        "tee": "0",
        "log_dir": None,
        "role": "default",
        "rdzv_backend": "static",
        "rdzv_conf": "",
        "max_restarts": 0,
        "monitor_interval": 0.1,
        "module": False,
        "no_python": False,
        "tpu_use_cluster": False,
        "vm": None,
        "main_training_function": None,
        "downcast_bf16": False,
        "gradient_clipping": None,
        "fsdp_version": "1",
        "fsdp_min_num_params": 10**8,
        "fsdp_offload_params": "false",
        "megatron_lm_tp_degree": 1,
        "megatron_lm_gradient_clipping": 1.0,
        "fp8_format": "HYBRID",
        "fp8_override_linear_precision": (False, False, False),
        "fp8_pad_inner_dim": True,
        "parallelism_config_sp_seq_length_is_variable": True,
        "parallelism_config_cp_backend": "torch",
        "mpirun_hostfile": None,
        "use_deepspeed": False,
    }
    assert {name: getattr(args, name) for name in expected} == expected
    assert args.nondefault == {}


def test_short_forms_and_types():
    args = parse("-t", "3", "-q", "-m", "--max-restarts", "2", "--monitor_interval", "0.5", "--num_processes", "4")
    assert (args.tee, args.quiet, args.module, args.max_restarts, args.monitor_interval) == ("3", True, True, 2, 0.5)
    assert args.num_processes == 4
    assert args.nondefault == {
        "tee": "-t",
        "quiet": "-q",
        "module": "-m",
        "max_restarts": "--max-restarts",
        "monitor_interval": "--monitor_interval",
        "num_processes": "--num_processes",
    }


def test_an_option_repeating_its_default_still_counts_as_given():
    flags = flags_from_args(parse("--role", "default", "--tee", "0"))
    assert (flags["role"], flags["tee"], flags["rdzv_conf"]) == ("default", "0", None)


# --- what the options do -------------------------------------------------------------------------------------


def test_torchrun_options_are_handed_to_torchrun(tmp_path):
    config = resolved(
        "--cpu",
        "--num_processes",
        "2",
        "--tee",
        "0:3,1:1",
        "--log_dir",
        str(tmp_path),
        "--role",
        "trainer",
        "--rdzv_conf",
        "join_timeout=30,read_timeout=10",
        "--max_restarts",
        "3",
        "--monitor_interval",
        "0.5",
    )
    argv = torchrun_argv(config, log_dir="/tmp/fallback")
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--tee"] == "0:3,1:1" and pairs["--log_dir"] == str(tmp_path) and pairs["--role"] == "trainer"
    assert pairs["--rdzv_conf"] == "join_timeout=30,read_timeout=10" and pairs["--max_restarts"] == "3"
    assert pairs["--monitor_interval"] == "0.5"
    assert torchrun_argv(LaunchConfig(training_script="t.py"), log_dir="/tmp/x")[:2] == ["--log_dir", "/tmp/x"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tee", "4"], "tee='4': expected 0, 1, 2 or 3"),
        (["--tee", "0:1,x"], "tee='0:1,x'"),
        (["--rdzv_conf", "timeout"], "rdzv_conf='timeout': expected key1=value1,key2=value2"),
        (["--rdzv_backend", "zookeeper"], "rdzv_backend='zookeeper': expected one of static, c10d"),
        (["--cpu", "--multi_gpu"], "cannot be used together"),
        (["--multi_gpu", "--num_processes", "1"], "multi_gpu needs at least 2 processes"),
        (["--no_python", "--main_training_function", "main"], "cannot be used with --no_python"),
    ],
)
def test_bad_values_name_the_option(argv, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        resolved(*argv)


def test_rendezvous_backend_and_port_on_one_machine():
    c10d = torchrun_argv(resolved("--rdzv_backend", "c10d", "--main_process_port", "2345"))
    assert c10d[c10d.index("--rdzv_endpoint") + 1] == "127.0.0.1:2345" and "c10d" in c10d
    static = torchrun_argv(resolved("--main_process_port", "2345"))
    assert static[static.index("--master_port") + 1] == "2345"
    assert "--standalone" in torchrun_argv(resolved("--main_process_port", "0"))  # HF's 0: a free port


def test_affinity_downcast_and_accumulation_reach_the_ranks():
    with pytest.warns(UserWarning, match="downcast_bf16 only affects bf16 training on TPUs"):
        env = child_env(
            resolved("--cpu", "--enable_cpu_affinity", "--downcast_bf16", "--gradient_accumulation_steps", "4"),
            environ={},
        )
    assert (env["ACCEL_CPU_AFFINITY"], env["ACCEL_DOWNCAST_BF16"], env["ACCEL_GRADIENT_ACCUMULATION_STEPS"]) == (
        "1",
        "1",
        "4",
    )
    assert "ACCEL_CPU_AFFINITY" not in child_env(resolved("--cpu"), environ={})


def test_the_config_files_keys_reach_the_launch(tmp_path):
    config = write(
        tmp_path / "c.yaml",
        """\
        distributed_type: MULTI_GPU
        num_processes: 4
        enable_cpu_affinity: true
        downcast_bf16: 'yes'
        rdzv_backend: c10d
        same_network: true
        main_training_function: main
        gpu_ids: 0,1,2,3
    """,
    )
    launch = resolved("--config_file", str(config))
    assert (launch.multi_gpu, launch.num_processes, launch.enable_cpu_affinity, launch.downcast_bf16) == (
        True,
        4,
        True,
        True,
    )
    assert (launch.rdzv_backend, launch.same_network, launch.gpu_ids) == ("c10d", True, "0,1,2,3")
    assert launch.main_training_function is None  # HF writes `main` into every file and reads it on TPUs only
    assert not resolved("--config_file", str(config), "--cpu").multi_gpu  # --cpu overrides the file's GPUs


def test_worker_target_for_main_function_module_and_pinned_executables():
    call = torchrun_argv(resolved("--main_training_function", "train"))
    assert call[-5:] == ["-m", "accel.cli.worker", "--call", "train", "train.py"]
    exe = torchrun_argv(resolved("--no_python", "--enable_cpu_affinity"))
    assert exe[-4:] == ["-m", "accel.cli.worker", "--exec", "train.py"]  # pinned first, then exec'd
    assert torchrun_argv(resolved("--no_python"))[-4:] == ["-m", "accel.cli.worker", "--exec", "train.py"]
    assert resolved("-q").quiet and resolved(environ={"ACCEL_QUIET": "1"}).quiet


# --- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,feature",
    [
        (["--use_megatron_lm"], "Megatron-LM"),
        (["--megatron_lm_tp_degree", "2"], "Megatron-LM"),
        (["--fp8_backend", "te"], "FP8"),
        (["--tpu"], "TPU"),
        (["--tpu_cluster"], "TPU"),
        (["--no_tpu_cluster"], "TPU"),
        (["--vm", "vm-1"], "TPU"),
        (["--env", "A=1"], "TPU"),
        (["--aws_access_key_id", "k"], "SageMaker"),
        (["--mpirun_hostfile", "hosts"], "mpirun"),
    ],
)
def test_backends_accel_does_not_run_are_refused_naming_the_flag(argv, feature):
    with pytest.raises(UnsupportedFeatureError) as error:
        flags_from_args(parse(*argv, "--cpu"))
    assert feature in error.value.feature and error.value.asked_by == argv[0] and error.value.instead


def test_the_parallelism_config_parses_and_only_sizes_beyond_data_parallelism_are_refused():
    fsdp2 = ("--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_version", "2", "--use_parallelism_config")
    assert resolved(*fsdp2, "--parallelism_config_dp_shard_size", "2").parallelism_config_dp_shard_size == 2
    with pytest.raises(UnsupportedFeatureError) as error:
        resolved(*fsdp2, "--parallelism_config_tp_size", "2")
    assert "Tensor, context and sequence parallelism" in error.value.feature and error.value.instead
    assert error.value.asked_by == "--parallelism_config_tp_size 2"


@pytest.mark.parametrize("layer", ["flag", "env", "config"])
def test_fp8_is_refused_naming_where_it_came_from(tmp_path, layer):
    config = write(tmp_path / "c.yaml", "distributed_type: NO\nmixed_precision: fp8\n")
    argv, environ, asked_by = {
        "flag": (["--mixed_precision", "fp8"], {}, "--mixed_precision fp8"),
        "env": ([], {"ACCEL_MIXED_PRECISION": "fp8"}, "ACCEL_MIXED_PRECISION=fp8"),
        "config": (["--config_file", str(config)], {}, f"{config}: mixed_precision: fp8"),
    }[layer]
    with pytest.raises(UnsupportedFeatureError, match="FP8") as error:
        resolved(*argv, environ=environ)
    assert error.value.asked_by == asked_by


def test_a_refused_option_stops_the_launch_before_anything_starts(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    assert main(["launch", "--cpu", "--use_megatron_lm", "--megatron_lm_tp_degree", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel launch: error: Megatron-LM is not supported by accel (asked for by --use_megatron_lm)")
    assert not marker.exists()


def test_a_config_file_asking_for_megatron_lm_exits_2_naming_the_key(tmp_path, capsys):
    config = write(tmp_path / "c.yaml", "distributed_type: MEGATRON_LM\nmegatron_lm_config: {tp_degree: 2}\n")
    assert main(["launch", "--config_file", str(config), "train.py"]) == 2
    assert f"Megatron-LM is not supported by accel (asked for by {config}: distributed_type: MEGATRON_LM)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["--num_procs", "2"], "--num_procs (did you mean --num_processes?)"),
        (["--mixed-precison", "bf16"], "--mixed-precison (did you mean --mixed_precision?)"),
        (["--enable_cpu_afinity"], "--enable_cpu_afinity (did you mean --enable_cpu_affinity?)"),
    ],
)
def test_an_unknown_option_gets_the_closest_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["launch", *argv, "train.py"])
    assert exit_.value.code == 2
    assert f"accel launch: error: unrecognized arguments: {hint}" in capsys.readouterr().err


# --- real launches -------------------------------------------------------------------------------------------

PINNED_SCRIPT = """
    import os, sys

    def main():
        line = (f"rank {os.environ['RANK']} role={os.environ['ROLE_NAME']} cpus={sorted(os.sched_getaffinity(0))} "
                f"downcast={os.environ.get('ACCEL_DOWNCAST_BF16')} argv={sys.argv[1:]}\\n")
        os.write(1, line.encode())

    if __name__ == "__main__":
        raise SystemExit("--main_training_function: the script must not run as __main__")
"""


@pytest.mark.slow
def test_tee_log_dir_role_affinity_and_main_function_in_one_launch(tmp_path):
    from test_launch import accel  # the installed CLI in a clean environment

    script = write(tmp_path / "pinned.py", PINNED_SCRIPT)
    logs = tmp_path / "logs"
    result = accel(
        tmp_path,
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "-t",
        "3",
        "--log_dir",
        str(logs),
        "--role",
        "trainer",
        "--enable_cpu_affinity",
        "--downcast_bf16",
        "--rdzv_conf",
        "join_timeout=60",
        "--main_training_function",
        "main",
        str(script),
        "x",
    )
    assert result.returncode == 0, result.stderr
    lines = sorted(line.split(":", 1)[1] for line in result.stdout.splitlines() if line.startswith("[trainer"))
    assert [line.split(" cpus=")[0] for line in lines] == ["rank 0 role=trainer", "rank 1 role=trainer"]
    assert all("downcast=1 argv=['x']" in line for line in lines)
    cpus = [set(json.loads(line.split("cpus=")[1].split(" ")[0])) for line in lines]
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus[0] and cpus[1] and not cpus[0] & cpus[1]
    logged = {path.parent.name: path.read_text() for path in logs.glob("*/attempt_0/*/stdout.log")}
    assert sorted(logged) == ["0", "1"] and logged["1"].startswith("rank 1 role=trainer")


@pytest.mark.slow
def test_quiet_shows_the_failing_rank_only(tmp_path):
    from test_launch import accel

    script = write(
        tmp_path / "fail.py",
        """
        import os
        if os.environ["RANK"] == "1":
            raise ValueError("rank one failed on purpose")
    """,
    )
    result = accel(tmp_path, "launch", "--cpu", "--num_processes", "2", "-q", str(script))
    assert result.returncode == 1
    assert "ValueError: rank one failed on purpose" in result.stderr
    assert "error_file" not in result.stderr and "Root Cause" not in result.stderr  # no launcher summary
    assert "torch.distributed.elastic" not in result.stderr  # nor the agent's log lines
