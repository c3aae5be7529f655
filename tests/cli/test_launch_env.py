"""HF's `accelerate.utils.launch` helpers on accel's launch resolution, and `PrepareForLaunch`."""

import argparse
import os
import sys

import pytest
import torch
import torch.distributed as dist

import accel.utils
from accel.commands.launch import launch_command_parser
from accel.launchers import PrepareForLaunch
from accel.unsupported import UnsupportedFeatureError


def test_the_helpers_are_accel_utils_names():
    for name in (
        "PrepareForLaunch",
        "prepare_simple_launcher_cmd_env",
        "prepare_multi_gpu_env",
        "prepare_deepspeed_cmd_env",
        "prepare_tpu",
        "prepare_sagemager_args_inputs",
        "merge_fsdp_weights",
    ):
        assert callable(getattr(accel.utils, name)), name
    from accel.utils.launch import prepare_simple_launcher_cmd_env

    assert prepare_simple_launcher_cmd_env is accel.utils.prepare_simple_launcher_cmd_env


def test_simple_launcher_command_and_environment():
    args = launch_command_parser().parse_args(
        [
            "--cpu",
            "--num_processes",
            "2",
            "--mixed_precision",
            "bf16",
            "--enable_cpu_affinity",
            "-m",
            "pkg.train",
            "--lr",
            "1",
        ]
    )
    before = dict(os.environ)
    cmd, env = accel.utils.prepare_simple_launcher_cmd_env(args)
    assert cmd == [sys.executable, "-m", "pkg.train", "--lr", "1"]
    assert env["ACCEL_MIXED_PRECISION"] == env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_USE_CPU"] == "true" and env["ACCELERATE_CPU_AFFINITY"] == "1"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert env["PATH"] == os.environ["PATH"] and dict(os.environ) == before  # a copy; this process is untouched
    executable = launch_command_parser().parse_args(["--no_python", "./run.sh", "x"])
    assert accel.utils.prepare_simple_launcher_cmd_env(executable)[0] == ["./run.sh", "x"]


def test_multi_gpu_env_sets_torchruns_names_on_args():
    args = launch_command_parser().parse_args(
        [
            "--num_processes",
            "4",
            "--num_machines",
            "2",
            "--machine_rank",
            "1",
            "--main_process_ip",
            "10.0.0.1",
            "--main_process_port",
            "1234",
            "--dynamo_backend",
            "inductor",
            "train.py",
        ]
    )
    env = accel.utils.prepare_multi_gpu_env(args)
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("2", "2", 1)
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 1234)
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    one = launch_command_parser().parse_args(["--num_processes", "2", "train.py"])
    accel.utils.prepare_multi_gpu_env(one)
    assert one.standalone  # no port on one machine: a free one


@pytest.mark.parametrize("attribute", ["use_megatron_lm", "tpu", "mpirun_hostfile"])
def test_namespaces_asking_for_other_backends_are_refused(attribute):
    args = launch_command_parser().parse_args(["train.py"])
    setattr(args, attribute, "hosts" if attribute == "mpirun_hostfile" else True)
    with pytest.raises(UnsupportedFeatureError, match=f"asked for by args.{attribute}="):
        accel.utils.prepare_multi_gpu_env(args)


def test_tpu_and_sagemaker_helpers_refuse():
    args = argparse.Namespace()
    with pytest.raises(UnsupportedFeatureError, match="TPU"):
        accel.utils.prepare_tpu(args, {})
    with pytest.raises(UnsupportedFeatureError, match="SageMaker"):
        accel.utils.prepare_sagemager_args_inputs(None, args)


def _seen(*args):
    return os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["ACCEL_FORK_LAUNCHED"], args


def test_prepare_for_launch_turns_the_index_into_the_rank(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("NPROC", "2")
    for name in ("RANK", "LOCAL_RANK", "ACCEL_FORK_LAUNCHED"):
        monkeypatch.setenv(name, "unset")  # so that monkeypatch restores them: the launcher sets them here
    seen = []
    PrepareForLaunch(lambda *args: seen.append(_seen(*args)), distributed_type="MULTI_CPU")(1, "x")
    assert seen == [("3", "1", "1", ("x",))]
    with pytest.raises(ValueError):
        PrepareForLaunch(_seen, distributed_type="MULTI_TPU")


def _sum_of_ranks(out_dir):
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    with open(os.path.join(out_dir, str(dist.get_rank())), "w") as handle:
        handle.write(str(total.item()))
    dist.destroy_process_group()


def test_prepare_for_launch_debug_joins_a_gloo_group(tmp_path, monkeypatch):
    from torch.multiprocessing import start_processes

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCEL_DEBUG_RDV_FILE", str(tmp_path / "rendezvous"))
    start_processes(PrepareForLaunch(_sum_of_ranks, debug=True), args=(str(tmp_path),), nprocs=2, start_method="fork")
    assert [(tmp_path / rank).read_text() for rank in ("0", "1")] == ["3", "3"]
