"""`srun accel launch`: the settings an srun step gives `accel launch`, where they sit among the layers, and a real
two-node job faked on one host.

No Slurm runs here: every test fakes the SLURM_* variables srun sets for one launcher task per node.
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from test_launch import run_launchers

from accel import slurm
from accel.cli.launch import LaunchError, flags_from_args, resolve, torchrun_argv
from accel.cli.main import build_parser


def launch_flags(*argv):
    return flags_from_args(build_parser().parse_args(["launch", *argv]))


def step(**variables):
    """What srun sets for the launcher on the second node of `srun -N2 --ntasks-per-node=1 accel launch ...` in a
    job of 8 nodes (None removes a variable)."""
    environ = {
        "SLURM_JOB_ID": "731234",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "8",
        "SLURM_STEP_NODELIST": "rack[2-3]-gpu[07]",
        "SLURM_JOB_NODELIST": "rack[1-4]-gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }
    environ.update(variables)
    return {name: value for name, value in environ.items() if value is not None}


def option(argv, name):
    return argv[argv.index(name) + 1]


def test_an_srun_step_gives_the_machines_their_rank_and_the_first_node():
    config = resolve(launch_flags("--cpu", "--num_processes", "4", "train.py"), environ=step())
    argv = torchrun_argv(config)
    assert (option(argv, "--nnodes"), option(argv, "--node_rank"), option(argv, "--nproc_per_node")) == ("2", "1", "2")
    assert option(argv, "--master_addr") == "rack2-gpu07"  # the step's first node, not the allocation's
    assert option(argv, "--master_port") == str(15000 + 1234)  # the job's port: jobs sharing a node do not collide
    assert "--standalone" not in argv


def test_gpus_slurm_gave_the_node_set_the_processes():
    config = resolve(launch_flags("train.py"), environ=step(SLURM_GPUS_ON_NODE="4"))
    assert config.num_processes == 8 and option(torchrun_argv(config), "--nproc_per_node") == "4"


def test_cpu_processes_keep_one_per_machine_unless_asked():
    # Slurm says how many launchers run, not how many CPU processes each should start.
    config = resolve(launch_flags("--cpu", "train.py"), environ=step(SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="64"))
    assert config.num_processes is None and option(torchrun_argv(config), "--nproc_per_node") == "1"


def test_flags_win_over_slurm():
    flags = launch_flags(
        "--num_machines",
        "3",
        "--machine_rank",
        "2",
        "--main_process_ip",
        "10.0.0.9",
        "--main_process_port",
        "1234",
        "--num_processes",
        "6",
        "train.py",
    )
    argv = torchrun_argv(resolve(flags, environ=step(SLURM_GPUS_ON_NODE="4")))
    assert [
        option(argv, name) for name in ("--nnodes", "--node_rank", "--nproc_per_node", "--master_addr", "--master_port")
    ] == ["3", "2", "2", "10.0.0.9", "1234"]


def test_a_flag_given_spares_reading_its_variables():
    # Every fact given: nothing of Slurm's is read, so a host list this launcher does not need cannot stop it.
    flags = launch_flags(
        "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.9", "--cpu", "train.py"
    )
    config = resolve(flags, environ=step(SLURM_STEP_NODELIST="rack[2-", SLURM_NODEID="x", SLURM_STEP_NUM_TASKS="4"))
    assert (config.num_machines, config.machine_rank, config.main_process_ip) == (2, 1, "10.0.0.9")


def test_accel_variables_win_over_slurm():
    environ = step(
        SLURM_GPUS_ON_NODE="4",
        ACCEL_MAIN_PROCESS_IP="10.0.0.5",
        ACCEL_NUM_PROCESSES="2",
        ACCEL_MAIN_PROCESS_PORT="2999",
    )
    config = resolve(launch_flags("train.py"), environ=environ)
    assert (config.main_process_ip, config.num_processes, config.main_process_port) == ("10.0.0.5", 2, 2999)
    assert (config.num_machines, config.machine_rank) == (2, 1)


def test_slurm_wins_over_the_config_file_but_keeps_its_port(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text(
        "distributed_type: MULTI_GPU\nnum_machines: 4\nmachine_rank: 0\nnum_processes: 32\n"
        "main_process_ip: 10.1.1.1\nmain_process_port: 29555\n"
    )
    config = resolve(launch_flags("--config_file", str(config_file), "train.py"), environ=step(SLURM_GPUS_ON_NODE="2"))
    assert (config.num_machines, config.machine_rank, config.main_process_ip) == (2, 1, "rack2-gpu07")
    assert (config.num_processes, config.main_process_port, config.multi_gpu) == (4, 29555, True)


def test_the_allocations_host_list_is_read_when_the_steps_is_missing():
    config = resolve(launch_flags("--cpu", "train.py"), environ=step(SLURM_STEP_NODELIST=None))
    assert config.main_process_ip == "rack1-gpu07"


def test_outside_an_srun_step_the_launch_is_as_without_slurm():
    # `accel launch` straight in a batch script: sbatch exports the allocation, but srun started nothing.
    environ = step(
        SLURM_STEP_NUM_TASKS=None,
        SLURM_STEP_NUM_NODES=None,
        SLURM_STEP_NODELIST=None,
        SLURM_STEP_TASKS_PER_NODE=None,
        SLURM_NODEID="0",
        SLURM_GPUS_ON_NODE="4",
    )
    config = resolve(launch_flags("--cpu", "train.py"), environ=environ)
    assert (config.num_machines, config.machine_rank, config.main_process_ip) == (1, 0, None)
    assert "--standalone" in torchrun_argv(config)


def test_a_one_node_step_keeps_picking_a_free_port():
    environ = step(
        SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NODELIST="gpu07",
        SLURM_NODEID="0",
        SLURM_STEP_TASKS_PER_NODE="1",
        SLURM_GPUS_ON_NODE="2",
    )
    config = resolve(launch_flags("train.py"), environ=environ)
    argv = torchrun_argv(config)
    assert "--standalone" in argv and config.main_process_port is None and option(argv, "--nproc_per_node") == "2"


@pytest.mark.parametrize(
    "variables,message",
    [
        (
            {"SLURM_STEP_NUM_TASKS": "4"},
            "SLURM_STEP_NUM_TASKS=4 with SLURM_STEP_NUM_NODES=2: `srun accel launch` starts the processes of one "
            "machine per task, so it needs one task per node (srun --ntasks-per-node=1)",
        ),
        ({"SLURM_STEP_NODELIST": "rack[2-3-gpu07"}, "SLURM_STEP_NODELIST='rack[2-3-gpu07': not a Slurm host list"),
        ({"SLURM_NODEID": "one"}, "SLURM_NODEID='one': not an integer"),
        ({"SLURM_NODEID": None}, "SLURM_NODEID is not set, though srun started this process"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below SLURM_STEP_NUM_NODES=2"),
        ({"SLURM_STEP_NUM_NODES": "0"}, "SLURM_STEP_NUM_NODES='0': must be at least 1"),
        ({"SLURM_GPUS_ON_NODE": "4 gpus"}, "SLURM_GPUS_ON_NODE='4 gpus': not an integer"),
        ({"SLURM_JOB_ID": "job7"}, "SLURM_JOB_ID='job7': not an integer"),
    ],
)
def test_bad_slurm_values_are_launch_errors_naming_the_variable(variables, message):
    with pytest.raises(LaunchError) as raised:
        resolve(launch_flags("train.py"), environ=step(**variables))
    assert message in str(raised.value)


def test_the_command_exits_2_naming_the_variable(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith(("ACCEL_", "ACCELERATE_"))}
    env.update(step(SLURM_STEP_NUM_TASKS="4"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "accel", "launch", "--cpu", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "srun --ntasks-per-node=1" in result.stderr


# --- a real job: two launchers as srun would start them on two nodes, here both on 127.0.0.1 ----------------------

RANK_SCRIPT = """
    import os
    from accel.state import PartialState
    state = PartialState()
    os.write(1, f"rank {state.process_index}/{state.num_processes} port={os.environ['MASTER_PORT']}\\n".encode())
    state.wait_for_everyone()
    state.destroy_process_group()
"""


def _free_job_id():
    """A job id whose port (accel.slurm.job_port) nothing listens on now, on 127.0.0.1."""
    for job_id in range(os.getpid() % 10000, os.getpid() % 10000 + 10000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", slurm.job_port({"SLURM_JOB_ID": str(job_id)})))
            except OSError:
                continue
        return str(job_id)
    raise RuntimeError("no free port in the job ports' range")


def _launcher_env(tmp_path, node, job_id):
    env = {
        name: value for name, value in os.environ.items() if not name.startswith(("ACCEL_", "ACCELERATE_", "SLURM_"))
    }
    if "ACCEL_DISABLE_NATIVE" in os.environ:  # keep the suite's native/fallback mode
        env["ACCEL_DISABLE_NATIVE"] = os.environ["ACCEL_DISABLE_NATIVE"]
    env.update(
        step(
            SLURM_JOB_ID=job_id,
            SLURM_STEP_NODELIST="127.0.0.1,127.0.0.1",
            SLURM_NODEID=str(node),
            SLURM_PROCID=str(node),
        ),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        TMPDIR=str(tmp_path),
        ACCEL_PROCESS_GROUP_TIMEOUT="60",
    )
    return env


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_srun_launchers_form_one_job(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    job_id = _free_job_id()
    command = [sys.executable, "-m", "accel", "launch", "--cpu", "--num_processes", "4", str(script)]
    results = run_launchers(tmp_path, command, [_launcher_env(tmp_path, node, job_id) for node in range(2)])
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err for _, _, err in results)
    lines = sorted(line for _, out, _ in results for line in out.splitlines() if line.startswith("rank"))
    port = slurm.job_port({"SLURM_JOB_ID": job_id})
    assert lines == [f"rank {rank}/4 port={port}" for rank in range(4)]
