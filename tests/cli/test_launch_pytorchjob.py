"""`accel launch` as the command of a Kubernetes PyTorchJob's pods: the PET_* variables Kubeflow sets for torchrun give
the machines, this pod's rank, the first pod's address and port and the processes per pod; where they sit among the
layers; bad values; and a real two-pod job faked on one host (two launchers on 127.0.0.1).

No Kubernetes runs here: every test fakes what Kubeflow's training operator sets in a pod."""

import os
import sys
import textwrap

import pytest
from test_launch import free_port, run_launchers

from accel.cli.launch import LaunchError, flags_from_args, resolve, torchrun_argv
from accel.cli.main import build_parser


def launch_flags(*argv):
    return flags_from_args(build_parser().parse_args(["launch", *argv]))


def pod(**variables):
    """The second pod of a job of 2 pods with 2 processes each (None removes a variable)."""
    environ = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-master-0.job.default.svc",
        "PET_MASTER_PORT": "23456",
        "PET_NPROC_PER_NODE": "2",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    }
    environ.update(variables)
    return {name: value for name, value in environ.items() if value is not None}


def option(argv, name):
    return argv[argv.index(name) + 1]


def test_a_pods_variables_give_the_machines_its_rank_the_first_pod_and_the_processes():
    config = resolve(launch_flags("--cpu", "train.py"), environ=pod())
    argv = torchrun_argv(config)
    assert (option(argv, "--nnodes"), option(argv, "--node_rank"), option(argv, "--nproc_per_node")) == ("2", "1", "2")
    assert (option(argv, "--master_addr"), option(argv, "--master_port")) == ("job-master-0.job.default.svc", "23456")


def test_flags_and_accel_variables_win_over_the_pod():
    flags = launch_flags("--cpu", "--machine_rank", "0", "--num_processes", "8", "train.py")
    config = resolve(flags, environ=pod(ACCEL_MAIN_PROCESS_PORT="29999"))
    assert (config.machine_rank, config.num_processes, config.main_process_port) == (0, 8, 29999)
    assert config.num_machines == 2


def test_a_non_numeric_process_count_leaves_accels_default():
    config = resolve(launch_flags("--cpu", "train.py"), environ=pod(PET_NPROC_PER_NODE="auto"))
    assert option(torchrun_argv(config), "--nproc_per_node") == "1"


def test_outside_a_pytorchjob_nothing_is_read():
    config = resolve(launch_flags("--cpu", "train.py"), environ=pod(PET_NNODES=None))
    assert config.num_machines == 1 and config.machine_rank == 0


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"PET_NNODES": "1:4"}, "PET_NNODES='1:4': an elastic range"),
        ({"PET_NNODES": "two"}, "PET_NNODES='two'"),
        ({"PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is not below PET_NNODES=2"),
        ({"PET_NODE_RANK": None}, "PET_NNODES=2 without PET_NODE_RANK"),
        ({"PET_MASTER_ADDR": None}, "PET_NNODES=2 without PET_MASTER_ADDR"),
        ({"PET_MASTER_PORT": "x"}, "PET_MASTER_PORT='x'"),
    ],
)
def test_bad_values_are_launch_errors_naming_the_variable(variables, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        resolve(launch_flags("--cpu", "train.py"), environ=pod(**variables))


def test_an_elastic_range_of_one_size_is_that_size():
    assert resolve(launch_flags("--cpu", "train.py"), environ=pod(PET_NNODES="2:2")).num_machines == 2


RANK_SCRIPT = """
    import os
    from accel.state import PartialState
    state = PartialState()
    os.write(1, f"rank {state.process_index}/{state.num_processes} local {state.local_process_index}\\n".encode())
    state.wait_for_everyone()
    state.destroy_process_group()
"""


def _pod_env(tmp_path, rank, port):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "SLURM_", "PET_"))}
    env.update(
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        TMPDIR=str(tmp_path),
        PET_NNODES="2",
        PET_NODE_RANK=str(rank),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
        PET_NPROC_PER_NODE="1",
        ACCEL_PROCESS_GROUP_TIMEOUT="60",  # a launcher waiting for a peer that never comes fails within a minute
    )
    if "ACCEL_DISABLE_NATIVE" in os.environ:  # keep the suite's native/fallback mode
        env["ACCEL_DISABLE_NATIVE"] = os.environ["ACCEL_DISABLE_NATIVE"]
    return env


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_pods_launchers_form_one_job(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    port = free_port()
    command = [sys.executable, "-m", "accel", "launch", "--cpu", str(script)]
    results = run_launchers(tmp_path, command, [_pod_env(tmp_path, rank, port) for rank in range(2)])
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err for _, _, err in results)
    lines = sorted(line for _, out, _ in results for line in out.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0/2 local 0", "rank 1/2 local 0"]
