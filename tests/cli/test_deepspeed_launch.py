"""DeepSpeed at `accel launch`: flags, config file and variables become the environment HF's launcher exports
(checked against HF Accelerate's own launcher and questionnaire where it is installed), what accel cannot start is
refused naming who asked, and `accel config` asks HF's DeepSpeed questions and writes HF's keys. No training: the
environment a launch exports is what is checked (one real launch shows it reaches the ranks)."""

import json
import os
import textwrap

import pytest
import yaml

from accel.cli.config_file import ConfigError, load_config
from accel.cli.launch import LaunchError, child_env, deepspeed_env, flags_from_args, resolve, torchrun_argv
from accel.cli.main import build_parser, main
from accel.unsupported import UnsupportedFeatureError

# Every DeepSpeed flag of HF Accelerate 1.15 but the multi-node ones, each set away from its default.
EVERY_FLAG = [
    "--use_deepspeed",
    "--deepspeed_config_file",
    "ds.json",
    "--zero_stage",
    "3",
    "--offload_optimizer_device",
    "nvme",
    "--offload_param_device",
    "CPU",
    "--offload_optimizer_nvme_path",
    "/nvme/opt",
    "--offload_param_nvme_path",
    "/nvme/param",
    "--gradient_accumulation_steps",
    "4",
    "--gradient_clipping",
    "0.5",
    "--zero3_init_flag",
    "true",
    "--zero3_save_16bit_model",
    "True",
    "--deepspeed_moe_layer_cls_names",
    "MixtralSparseMoeBlock",
]
EVERY_FLAG_HF_NAMES = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_CONFIG_DS_FIELDS": "",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "/nvme/opt",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "/nvme/param",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
    "ACCELERATE_GRADIENT_CLIPPING": "0.5",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "MixtralSparseMoeBlock",
}
# HF's launcher parses the NVMe paths but does not export them; the plugin reads them, so accel does.
NOT_EXPORTED_BY_HF = (
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
)

# What HF Accelerate 1.15's questionnaire writes for ZeRO-3 with CPU offload on one machine (its ClusterConfig).
HF_ZERO3 = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
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
# ... and with a DeepSpeed config file: no mixed_precision key (the JSON file holds the precision).
HF_CONFIG_FILE = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_config_file: /cfg/ds.json
  zero3_init_flag: false
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def resolved(*argv, environ=None):
    return resolve(flags_from_args(build_parser().parse_args(["launch", *argv, "train.py"])), environ=environ or {})


def is_deepspeed_variable(name):
    return "DEEPSPEED" in name or name.endswith(
        ("_CONFIG_DS_FIELDS", "_GRADIENT_ACCUMULATION_STEPS", "_GRADIENT_CLIPPING")
    )


def ds_env(config, environ=None):
    """The DeepSpeed variables the launch exports to every rank, both spellings."""
    return {
        name: value for name, value in child_env(config, environ=environ or {}).items() if is_deepspeed_variable(name)
    }


def hf_names(env):
    return {name: value for name, value in env.items() if name.startswith("ACCELERATE_")}


def hf_deepspeed_env(*argv):
    """The DeepSpeed variables (and PYTHONPATH, ACCELERATE_MIXED_PRECISION) HF Accelerate's own launcher exports for
    `accelerate launch ARGV train.py`, through its launch_command's preparation and prepare_deepspeed_cmd_env."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    fixed = ["--num_processes", "2", "--main_process_port", "29512", "--dynamo_backend", "no"]
    args = launch_command_parser().parse_args([*argv, *fixed, "train.py"])
    args, defaults, precision_from_file = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config) if defaults else []
    args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * precision_from_file)
    cmd, env = prepare_deepspeed_cmd_env(args)
    assert cmd is None  # HF's torch.distributed.run path
    return {
        name: value
        for name, value in env.items()
        if is_deepspeed_variable(name) or name in ("PYTHONPATH", "ACCELERATE_MIXED_PRECISION")
    }


def assert_exports_what_hf_exports(config, hf_env):
    env = child_env(config, environ=os.environ)
    assert env["PYTHONPATH"] == hf_env.pop("PYTHONPATH")  # HF adds the working folder; so does accel
    assert env["ACCEL_MIXED_PRECISION"] == hf_env.pop("ACCELERATE_MIXED_PRECISION")
    exported = ds_env(config)
    assert {name: value for name, value in hf_names(exported).items() if name not in NOT_EXPORTED_BY_HF} == hf_env
    assert {name.replace("ACCELERATE_", "ACCEL_", 1): value for name, value in hf_names(exported).items()} == {
        name: value for name, value in exported.items() if name.startswith("ACCEL_")
    }  # accel's names, same values


# --- flags, config file and variables -> the ranks' environment ----------------------------------------------


def test_every_hf_deepspeed_flag_reaches_the_ranks_under_hfs_and_accels_names():
    exported = ds_env(resolved(*EVERY_FLAG))
    assert hf_names(exported) == EVERY_FLAG_HF_NAMES
    assert {name: value for name, value in exported.items() if name.startswith("ACCEL_")} == {
        name.replace("ACCELERATE_", "ACCEL_", 1): value for name, value in EVERY_FLAG_HF_NAMES.items()
    }
    assert ds_env(resolved("--use_deepspeed")) == {
        "ACCEL_USE_DEEPSPEED": "true",
        "ACCEL_CONFIG_DS_FIELDS": "",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_CONFIG_DS_FIELDS": "",
    }


def test_the_deepspeed_plugin_reads_the_exported_settings(monkeypatch):
    from accel.backends.deepspeed import DeepSpeedPlugin

    for name, value in ds_env(resolved(*EVERY_FLAG[:1], *EVERY_FLAG[3:])).items():  # without the JSON file
        monkeypatch.setenv(name, value)
    plugin = DeepSpeedPlugin()
    assert (plugin.zero_stage, plugin.offload_param_device, plugin.offload_optimizer_nvme_path) == (
        3,
        "cpu",
        "/nvme/opt",
    )
    assert (plugin.gradient_accumulation_steps, plugin.gradient_clipping, plugin.zero3_init_flag) == (4, 0.5, True)
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"] == {
        "device": "nvme",
        "nvme_path": "/nvme/opt",
    }


@pytest.mark.parametrize(
    "argv",
    [EVERY_FLAG, ["--use_deepspeed"], ["--use_deepspeed", "--zero_stage", "1", "--mixed_precision", "bf16"]],
    ids=["every flag", "bare", "stage 1 bf16"],
)
def test_deepspeed_flags_export_what_hf_accelerates_launcher_exports(argv):
    assert_exports_what_hf_exports(resolved(*argv), hf_deepspeed_env(*argv))


@pytest.mark.parametrize("text", [HF_ZERO3, HF_CONFIG_FILE], ids=["zero3", "config file"])
def test_hf_deepspeed_config_files_export_what_hf_accelerates_launcher_exports(tmp_path, text):
    path = write(tmp_path / "ds.yaml", text)
    config = resolved("--config_file", str(path))
    assert config.use_deepspeed and not config.use_cpu
    assert_exports_what_hf_exports(config, hf_deepspeed_env("--config_file", str(path)))


def test_config_ds_fields_name_the_files_deepspeed_settings_and_its_precision(tmp_path):
    path = write(tmp_path / "ds.yaml", HF_ZERO3)
    fields = (
        "gradient_accumulation_steps,gradient_clipping,offload_optimizer_device,offload_param_device,"
        "zero3_init_flag,zero3_save_16bit_model,zero_stage"
    )
    assert ds_env(resolved("--config_file", str(path)))["ACCELERATE_CONFIG_DS_FIELDS"] == fields + ",mixed_precision"
    # A precision given above the file is not the file's (HF: only --mixed_precision; accel's variable too).
    for argv, environ in ((["--mixed_precision", "fp16"], {}), ([], {"ACCEL_MIXED_PRECISION": "fp16"})):
        env = ds_env(resolved("--config_file", str(path), *argv, environ=environ))
        assert env["ACCELERATE_CONFIG_DS_FIELDS"] == env["ACCEL_CONFIG_DS_FIELDS"] == fields
    assert (
        ds_env(resolved("--config_file", str(write(tmp_path / "f.yaml", HF_CONFIG_FILE))))[
            "ACCELERATE_CONFIG_DS_FIELDS"
        ]
        == "deepspeed_config_file,zero3_init_flag"
    )


def test_precedence_config_file_then_variables_then_flags(tmp_path):
    path = write(tmp_path / "ds.yaml", HF_ZERO3)
    environ = {
        "ACCEL_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_GRADIENT_CLIPPING": "2.0",
    }
    env = ds_env(
        resolved("--config_file", str(path), "--zero_stage", "1", "--offload_optimizer_device", "none", environ=environ)
    )
    assert (env["ACCEL_DEEPSPEED_ZERO_STAGE"], env["ACCELERATE_DEEPSPEED_ZERO_STAGE"]) == ("1", "1")  # flag
    assert (env["ACCEL_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"], env["ACCEL_GRADIENT_CLIPPING"]) == ("none", "2.0")
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"  # accel's variable over the file
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"  # the file's, where nothing else says
    # Both spellings are exported, so an inherited one cannot contradict the launcher in the ranks.
    assert (
        resolved(
            "--use_deepspeed", environ={"ACCEL_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}
        ).zero_stage
        == 3
    )


@pytest.mark.parametrize("name", ["ACCEL_USE_DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"])
def test_the_deepspeed_switch_is_read_from_accels_and_hfs_variable(name):
    config = resolved("--cpu", environ={name: "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    assert config.use_deepspeed and ds_env(config)["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    off = resolved("--cpu", environ={"ACCEL_USE_DEEPSPEED": "false", "ACCELERATE_USE_DEEPSPEED": "true"})
    assert not off.use_deepspeed  # accel's spelling wins, as everywhere


def test_without_deepspeed_nothing_of_it_is_exported():
    assert ds_env(resolved("--cpu")) == {"ACCEL_USE_DEEPSPEED": "false"}
    assert "PYTHONPATH" not in child_env(resolved("--cpu"), environ={})
    # The ranks follow the launcher, not an inherited ACCELERATE_USE_DEEPSPEED=true turned off by --multi_gpu.
    ddp = resolved("--multi_gpu", "--num_processes", "2", environ={"ACCELERATE_USE_DEEPSPEED": "true"})
    assert not ddp.use_deepspeed
    assert deepspeed_env(ddp, environ={"ACCELERATE_USE_DEEPSPEED": "true"}) == {
        "ACCEL_USE_DEEPSPEED": "false",
        "ACCELERATE_USE_DEEPSPEED": "false",
    }


def test_multi_gpu_or_fsdp_over_a_deepspeed_config_run_them_and_deepspeed_over_fsdp_runs_deepspeed(tmp_path):
    deepspeed = write(tmp_path / "ds.yaml", HF_ZERO3)
    ddp = resolved("--config_file", str(deepspeed), "--multi_gpu")
    assert (ddp.multi_gpu, ddp.use_deepspeed, ddp.use_fsdp) == (True, False, False)
    fsdp = resolved("--config_file", str(deepspeed), "--use_fsdp", "--fsdp_version", "2")
    assert (fsdp.use_deepspeed, fsdp.use_fsdp) == (False, True)
    on_cpu = resolved("--config_file", str(deepspeed), "--cpu")
    assert on_cpu.use_deepspeed and on_cpu.use_cpu  # HF's --cpu runs without DeepSpeed; accel runs it on CPUs
    fsdp_file = write(tmp_path / "fsdp.yaml", "distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\n")
    over_fsdp = resolved("--config_file", str(fsdp_file), "--use_deepspeed", environ={"ACCELERATE_USE_FSDP": "true"})
    assert (over_fsdp.use_deepspeed, over_fsdp.use_fsdp) == (True, False)
    assert child_env(over_fsdp, environ={})["ACCEL_USE_FSDP"] == "false"


def test_deepspeed_with_fsdp_is_an_error_naming_both(capsys):
    assert main(["launch", "--use_deepspeed", "--use_fsdp", "train.py"]) == 2
    assert "--use_deepspeed and --use_fsdp cannot be used together" in capsys.readouterr().err
    with pytest.raises(LaunchError, match="ACCEL_USE_DEEPSPEED and ACCELERATE_USE_FSDP cannot be used together"):
        resolved(environ={"ACCEL_USE_DEEPSPEED": "1", "ACCELERATE_USE_FSDP": "1"})


@pytest.mark.parametrize("cpu", [["--cpu"], []], ids=["cpu", "gpus"])
def test_use_deepspeed_with_num_processes_starts_that_many_with_and_without_cpu(cpu):
    config = resolved(*cpu, "--use_deepspeed", "--num_processes", "2")
    argv = torchrun_argv(config)
    assert argv[argv.index("--nproc_per_node") + 1] == "2" and "--standalone" in argv
    env = child_env(config, environ={})
    assert (env["ACCEL_USE_CPU"], env["ACCEL_USE_DEEPSPEED"]) == ("true" if cpu else "false", "true")


def test_multi_machine_standard_launch_runs_on_each_machine():
    config = resolved(
        "--use_deepspeed",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--num_processes",
        "4",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29600",
        "--deepspeed_multinode_launcher",
        "standard",
    )
    argv = torchrun_argv(config)
    assert [
        argv[argv.index(name) + 1] for name in ("--nnodes", "--node_rank", "--nproc_per_node", "--master_addr")
    ] == ["2", "1", "2", "10.0.0.1"]
    # An unset launcher is accel's own start (HF's default would be pdsh).
    assert resolved("--use_deepspeed", "--num_machines", "2", "--main_process_ip", "h").use_deepspeed


# --- refusals ------------------------------------------------------------------------------------------------

MULTI_MACHINE = ["--use_deepspeed", "--num_machines", "2", "--main_process_ip", "10.0.0.1"]


@pytest.mark.parametrize(
    "argv,asked_by",
    [
        (["--deepspeed_multinode_launcher", "pdsh"], "--deepspeed_multinode_launcher pdsh"),
        (["--deepspeed_multinode_launcher", "OpenMPI"], "--deepspeed_multinode_launcher openmpi"),
        (["--deepspeed_multinode_launcher", "slurm"], "--deepspeed_multinode_launcher slurm"),
        (["--deepspeed_multinode_launcher", "nossh"], "--deepspeed_multinode_launcher nossh"),
        (["--deepspeed_hostfile", "/job/hostfile"], "--deepspeed_hostfile /job/hostfile"),
        (["--deepspeed_inclusion_filter", "worker-0"], "--deepspeed_inclusion_filter worker-0"),
        (
            ["--deepspeed_multinode_launcher", "standard", "--deepspeed_exclusion_filter", "worker-1:0"],
            "--deepspeed_exclusion_filter worker-1:0",
        ),
    ],
)
def test_deepspeeds_own_multinode_starts_are_refused_naming_the_option(tmp_path, capsys, argv, asked_by):
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    assert main(["launch", *MULTI_MACHINE, *argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accel launch: error: Starting DeepSpeed's machines with its own launcher")
    assert f"(asked for by {asked_by} with num_machines=2)" in err
    assert (
        "run `accel launch --use_deepspeed --num_machines N --machine_rank R --main_process_ip IP ...` on each "
        "machine" in err
    )
    assert not marker.exists()
    # On one machine HF ignores them (its torch.distributed.run path): so does accel.
    assert resolved("--use_deepspeed", *argv).use_deepspeed


def test_a_multinode_launcher_in_the_config_file_or_a_variable_is_refused_naming_it(tmp_path):
    path = write(
        tmp_path / "ds.yaml",
        HF_ZERO3.replace("num_machines: 1", "num_machines: 2\nmain_process_ip: h").replace(
            "  zero_stage: 3",
            "  zero_stage: 3\n  deepspeed_multinode_launcher: pdsh\n  deepspeed_hostfile: /job/hostfile",
        ),
    )
    with pytest.raises(UnsupportedFeatureError) as error:
        resolved("--config_file", str(path))
    assert error.value.asked_by == f"{path}: deepspeed_config.deepspeed_multinode_launcher: pdsh with num_machines=2"
    with pytest.raises(UnsupportedFeatureError) as error:
        resolved("--config_file", str(path), "--deepspeed_multinode_launcher", "standard")
    assert error.value.asked_by == f"{path}: deepspeed_config.deepspeed_hostfile: /job/hostfile with num_machines=2"
    with pytest.raises(UnsupportedFeatureError) as error:
        resolved(*MULTI_MACHINE, environ={"ACCEL_DEEPSPEED_MULTINODE_LAUNCHER": "mvapich"})
    assert error.value.asked_by == "ACCEL_DEEPSPEED_MULTINODE_LAUNCHER=mvapich with num_machines=2"


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--zero_stage", "2"),
        ("--gradient_clipping", "1.0"),
        ("--offload_param_device", "cpu"),
        ("--deepspeed_config_file", "ds.json"),
        ("--zero3_init_flag", "true"),
        ("--deepspeed_hostfile", "hosts"),
    ],
)
def test_deepspeed_flags_without_deepspeed_are_refused_naming_the_flag(flag, value, capsys):
    assert main(["launch", "--cpu", flag, value, "train.py"]) == 2
    assert (
        f"accel launch: error: {flag} has no effect without DeepSpeed: add --use_deepspeed (or use a config file "
        "with distributed_type: DEEPSPEED)"
    ) in capsys.readouterr().err
    assert resolved("--cpu", "--gradient_accumulation_steps", "2").gradient_accumulation_steps == 2  # every launch's


@pytest.mark.parametrize(
    "argv,environ,message",
    [
        (
            ["--offload_param_device", "gpu"],
            {},
            "--offload_param_device: 'gpu' is not valid; allowed values: none, cpu, nvme",
        ),
        (["--zero_stage", "4"], {}, "--zero_stage: 4 is not valid; allowed values: 0, 1, 2, 3"),
        (["--zero3_init_flag", "maybe"], {}, "--zero3_init_flag: 'maybe' is not valid; expected true or false"),
        (
            ["--gradient_accumulation_steps", "0"],
            {},
            "--gradient_accumulation_steps: 0 is not valid; expected an integer",
        ),
        (
            ["--deepspeed_multinode_launcher", "ssh"],
            {},
            "allowed values: pdsh, standard, openmpi, mvapich, mpich, nossh",
        ),
        ([], {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "three"}, "ACCELERATE_DEEPSPEED_ZERO_STAGE: 'three' is not valid"),
    ],
)
def test_bad_deepspeed_values_name_the_flag_or_variable(argv, environ, message):
    with pytest.raises(LaunchError) as error:
        resolved("--use_deepspeed", *argv, environ=environ)
    assert message in str(error.value)


def test_a_bad_deepspeed_config_key_or_value_names_it(tmp_path):
    typo = write(tmp_path / "typo.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stag: 2}\n")
    with pytest.raises(
        ConfigError,
        match=r"deepspeed_config.zero_stag: 2 is not valid; unknown key \(did you mean "
        r"'zero_stage'\?\)",
    ):
        load_config(typo)
    bad = write(tmp_path / "bad.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config: {offload_param_device: disk}\n")
    with pytest.raises(
        ConfigError, match="deepspeed_config.offload_param_device: 'disk' is not valid; allowed values: none, cpu, nvme"
    ):
        load_config(bad)


# --- HF's files and `accel config update` ----------------------------------------------------------------------


@pytest.mark.parametrize("text", [HF_ZERO3, HF_CONFIG_FILE], ids=["zero3", "config file"])
def test_hf_deepspeed_config_files_load_and_round_trip_unchanged(tmp_path, text):
    path = write(tmp_path / "default_config.yaml", text)
    config = load_config(path)
    config.check_supported()
    assert config.to_dict() == yaml.safe_load(text)
    assert main(["config", "update", "--config_file", str(path)]) == 0
    assert path.read_text() == text  # no mixed_precision added beside a deepspeed_config_file


# --- `accel config`: HF's questions, HF's YAML, and the launch it makes -----------------------------------------


def hf_questionnaire(monkeypatch, answers):
    """What HF Accelerate's own questionnaire (get_cluster_input) writes for `answers`: option numbers for its
    menus, text for its other questions."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config import cluster

    queue = list(answers)

    def ask_options(text, options=(), convert_value=None, default=0):
        index = int(queue.pop(0) or default)
        return convert_value(index) if convert_value is not None else index

    monkeypatch.setattr(cluster, "_ask_options", ask_options)
    monkeypatch.setattr("builtins.input", lambda prompt="": queue.pop(0))
    config = cluster.get_cluster_input().to_dict()
    assert queue == []
    return config


# The DeepSpeed questions of both questionnaires: no JSON file, ZeRO-3, optimizer states to the CPU, parameters to
# NVMe at /mnt/nvme, 4 accumulation steps, clipping at 0.5, 16-bit saving, zero.Init, MoE.
ZERO3_ANSWERS = [
    "yes",
    "no",
    "3",
    "1",
    "2",
    "/mnt/nvme",
    "4",
    "yes",
    "0.5",
    "yes",
    "yes",
    "yes",
    "MixtralSparseMoeBlock",
]
HF_WRITES_ALIKE = (
    "compute_environment",
    "distributed_type",
    "deepspeed_config",
    "mixed_precision",
    "use_cpu",
    "debug",
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "same_network",
    "rdzv_backend",
    "gpu_ids",
    "enable_cpu_affinity",
)


def assert_written_as_hf_writes(saved, hf_config):
    assert {key: saved.get(key) for key in HF_WRITES_ALIKE} == {key: hf_config.get(key) for key in HF_WRITES_ALIKE}


def test_deepspeed_answers_on_two_machines_are_saved_as_hf_writes_them_and_launch(tmp_path, monkeypatch):
    from test_config_questionnaire import run_accel, saved_yaml

    # Two machines, this one rank 1, on the same network; no debug, no dynamo.
    machines = ["2", "1", "10.0.0.1", "29600", "yes", "no", "no"]
    rest = ["1", "4", "2"]  # the standard launcher, 4 GPUs in total, bf16
    path = tmp_path / "ds.yaml"
    saved = saved_yaml(
        run_accel(
            tmp_path, ["config", "--config_file", str(path)], ["0", "multi-GPU", *machines, *ZERO3_ANSWERS, *rest]
        ),
        path,
    )
    assert saved["deepspeed_config"] == {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "nvme",
        "offload_param_nvme_path": "/mnt/nvme",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": True,
        "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock",
        "deepspeed_multinode_launcher": "standard",
    }
    assert_written_as_hf_writes(saved, hf_questionnaire(monkeypatch, ["4", *machines, *ZERO3_ANSWERS, *rest]))
    config = resolved("--config_file", str(path))
    assert_exports_what_hf_exports(config, hf_deepspeed_env("--config_file", str(path)))
    argv = torchrun_argv(config)
    assert [argv[argv.index(name) + 1] for name in ("--nnodes", "--node_rank", "--nproc_per_node")] == ["2", "1", "2"]


def test_deepspeed_with_a_json_file_on_the_cpu_leaves_the_precision_to_the_file(tmp_path, monkeypatch):
    from test_config_questionnaire import run_accel, saved_yaml

    deepspeed = ["yes", "yes", "/cfg/ds.json", "no", "no", "2"]  # a JSON file, no zero.Init, no MoE, 2 processes
    path = tmp_path / "ds.yaml"
    # No distributed training, CPU only, no IPEX (accel's question), no dynamo; no precision question follows.
    saved = saved_yaml(
        run_accel(tmp_path, ["config", "--config_file", str(path)], ["0", "0", "yes", "no", "no", *deepspeed]), path
    )
    assert saved["deepspeed_config"] == {"deepspeed_config_file": "/cfg/ds.json", "zero3_init_flag": False}
    assert "mixed_precision" not in saved and saved["use_cpu"]
    assert_written_as_hf_writes(saved, hf_questionnaire(monkeypatch, ["0", "yes", "no", *deepspeed]))
    env = ds_env(resolved("--config_file", str(path)))
    assert env["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,zero3_init_flag"  # no mixed_precision
    assert child_env(resolved("--config_file", str(path)), environ={})["ACCEL_USE_CPU"] == "true"


def test_only_the_standard_multinode_launcher_is_taken(tmp_path):
    from test_config_questionnaire import run_accel, saved_yaml

    answers = [
        "0",
        "multi-GPU",
        "2",
        "0",
        "10.0.0.1",
        "29600",
        "yes",
        "no",
        "no",
        "yes",
        "no",
        "",
        "",
        "",
        "",
        "no",
        "no",
        "no",  # ZeRO-2 with the defaults, no zero.Init, no MoE
        "pdsh",
        "",
        "2",
        "no",
    ]  # pdsh refused, then the default (standard), 2 GPUs, no mixed precision
    path = tmp_path / "ds.yaml"
    result = run_accel(tmp_path, ["config", "--config_file", str(path)], answers)
    saved = saved_yaml(result, path)
    assert "pdsh is not supported by accel: accel starts every machine through torch.distributed.run" in result.stdout
    assert saved["deepspeed_config"] == {
        "zero_stage": 2,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "gradient_accumulation_steps": 1,
        "zero3_init_flag": False,
        "deepspeed_multinode_launcher": "standard",
    }
    assert "DeepSpeed hostfile" not in result.stdout  # pdsh's questions never come


# --- HF's launch helper --------------------------------------------------------------------------------------


def test_prepare_deepspeed_cmd_env_returns_what_hfs_returns_on_its_torchrun_path():
    from accel.commands.launch import launch_command_parser
    from accel.utils.launch import prepare_deepspeed_cmd_env

    argv = ["--zero_stage", "3", "--gradient_clipping", "1.0", "--num_processes", "2", "--main_process_port", "29512"]
    args = launch_command_parser().parse_args([*argv, "train.py"])
    args.deepspeed_fields_from_accelerate_config = "zero_stage,mixed_precision"
    before = dict(os.environ)
    cmd, env = prepare_deepspeed_cmd_env(args)
    assert cmd is None and (args.nproc_per_node, args.master_port, args.deepspeed_multinode_launcher) == (
        "2",
        29512,
        "standard",
    )
    assert dict(os.environ) == before  # a copy; this process is untouched
    hf_env = hf_deepspeed_env("--use_deepspeed", *argv)
    hf_env["ACCELERATE_CONFIG_DS_FIELDS"] = "zero_stage,mixed_precision"  # as HF's launch_command would set it
    assert {name: env[name] for name in hf_env} == hf_env
    two = launch_command_parser().parse_args(
        [
            "--num_processes",
            "4",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.0.0.1",
            "train.py",
        ]
    )
    assert prepare_deepspeed_cmd_env(two)[1]["ACCEL_USE_DEEPSPEED"] == "true"
    assert (two.nnodes, two.node_rank, two.nproc_per_node) == ("2", 1, "2")
    two.deepspeed_multinode_launcher = "pdsh"
    refused = "asked for by args.deepspeed_multinode_launcher=pdsh with num_machines=2"
    with pytest.raises(UnsupportedFeatureError, match=refused):
        prepare_deepspeed_cmd_env(two)


# --- a real launch -------------------------------------------------------------------------------------------

ENV_SCRIPT = """
    import json, os
    seen = {name: value for name, value in os.environ.items() if "DEEPSPEED" in name or "DS_FIELDS" in name}
    os.write(1, ("rank " + os.environ["RANK"] + " " + json.dumps(seen, sort_keys=True) + "\\n").encode())
"""


@pytest.mark.slow
def test_the_ranks_see_the_deepspeed_environment(tmp_path):
    from test_launch import accel, isolated_env

    script = write(tmp_path / "env.py", ENV_SCRIPT)
    argv = ["--cpu", "--use_deepspeed", "--num_processes", "2", "--zero_stage", "3", "--offload_param_device", "cpu"]
    result = accel(tmp_path, "launch", *argv, str(script), env=isolated_env(tmp_path))
    assert result.returncode == 0, result.stderr
    seen = sorted(line.split(" ", 2)[1:] for line in result.stdout.splitlines() if line.startswith("rank"))
    assert [rank for rank, _ in seen] == ["0", "1"]
    expected = {name: value for name, value in deepspeed_env(resolved(*argv)).items() if name != "PYTHONPATH"}
    assert expected["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert all(json.loads(variables) == expected for _, variables in seen)
