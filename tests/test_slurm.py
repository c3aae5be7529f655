"""accel.slurm: Slurm's host lists and task counts, and a script srun starts once per process (no launcher).

No Slurm runs here: every test fakes the SLURM_* variables srun would set. The real run starts two Python
processes as srun would (SLURM_PROCID 0 and 1 of a two-task step on one node) and they meet on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from accel import slurm
from accel.state import DistributedType, PartialState

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- host lists ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostlist,hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[8-10]", ["node8", "node9", "node10"]),  # no padding asked for, none added
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),  # padding kept past a carry
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("a[1,3],b[2-3]c,d", ["a1", "a3", "b2c", "b3c", "d"]),
        ("[1-2]x", ["1x", "2x"]),
        ("node[5]", ["node5"]),
        ("127.0.0.1", ["127.0.0.1"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts
    assert slurm.first_host(hostlist) == hosts[0]


@pytest.mark.parametrize(
    "hostlist,why",
    [
        ("node[01-03", "a bracket is not closed"),
        ("node01]", "a bracket closes that was not opened"),
        ("node[[1-2]]", "brackets do not nest"),
        ("a,,b", "an empty entry"),
        ("", "an empty entry"),
        ("a,", "an empty entry"),
        ("node[]", "not a number or a range"),
        ("node[1-]", "'1-', which is not a number or a range"),
        ("node[a-c]", "not a number or a range"),
        ("node[1-3:2]", "not a number or a range"),
        ("node[5-2]", "the range '5-2' ends before it starts"),
        ("a b", "holds a space"),
    ],
)
def test_a_malformed_host_list_is_an_error_naming_the_variable_and_the_value(hostlist, why):
    with pytest.raises(slurm.SlurmError, match="SLURM_JOB_NODELIST=") as raised:
        slurm.expand_hostlist(hostlist, "SLURM_JOB_NODELIST")
    assert repr(hostlist) in str(raised.value) and why in str(raised.value)
    with pytest.raises(slurm.SlurmError, match=why.replace("[", r"\[")):
        slurm.first_host(hostlist, "SLURM_JOB_NODELIST")  # checked whole, though only the first host is needed


def test_the_first_host_of_a_huge_list_does_not_expand_it():
    assert slurm.first_host("node[0000001-9999999],other[1-9999999]") == "node0000001"


# --- task counts and the job's port --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,counts",
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), ("8(x1)", [8])],
)
def test_tasks_per_node_reads_slurms_compact_form(value, counts):
    assert slurm.tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2x3", "2(x)", "two", "2(3)", "2(x3)1"])
def test_malformed_tasks_per_node_names_the_variable(value):
    with pytest.raises(slurm.SlurmError, match=r"SLURM_STEP_TASKS_PER_NODE=.*is not a task count"):
        slurm.tasks_per_node(value, "SLURM_STEP_TASKS_PER_NODE")


def test_the_port_follows_the_job_id():
    assert slurm.job_port({"SLURM_JOB_ID": "123456"}) == 15000 + 3456
    assert slurm.job_port({"SLURM_JOB_ID": "7"}) == 15007
    assert slurm.job_port({}) == 29500
    with pytest.raises(slurm.SlurmError, match="SLURM_JOB_ID='12a': not an integer"):
        slurm.job_port({"SLURM_JOB_ID": "12a"})


# --- one srun task per process ---------------------------------------------------------------------------------------


def step(**variables: str) -> dict[str, str]:
    """What srun sets for task 3 of `srun -N2 --ntasks-per-node=2 python x.py` (node 1, its second task)."""
    environ = {
        "SLURM_JOB_ID": "880042",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[01-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
    }
    environ.update(variables)
    return {name: value for name, value in environ.items() if value is not None}


def test_an_srun_task_gets_its_rank_local_rank_world_and_rendezvous():
    assert slurm.task_environment(step()) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",  # the step's first node, not the allocation's
        "MASTER_PORT": str(15000 + 42),
    }


def test_uneven_nodes_get_their_own_local_world_size():
    environ = step(
        SLURM_STEP_NUM_TASKS="7",
        SLURM_STEP_NUM_NODES="3",
        SLURM_STEP_NODELIST="n[1-3]",
        SLURM_STEP_TASKS_PER_NODE="3(x2),1",
        SLURM_NODEID="2",
        SLURM_PROCID="6",
        SLURM_LOCALID="0",
    )
    variables = slurm.task_environment(environ)
    assert (variables["RANK"], variables["WORLD_SIZE"], variables["LOCAL_WORLD_SIZE"]) == ("6", "7", "1")


def test_the_allocations_variables_are_read_when_the_steps_are_missing():
    environ = step(
        SLURM_STEP_NODELIST=None,
        SLURM_STEP_TASKS_PER_NODE=None,
        SLURM_STEP_NUM_NODES=None,
        SLURM_TASKS_PER_NODE="2(x2)",
    )
    assert slurm.task_environment(environ)["MASTER_ADDR"] == "gpu01"


def test_a_given_master_address_and_port_are_kept():
    variables = slurm.task_environment(step(MASTER_ADDR="10.1.2.3", MASTER_PORT="4567"))
    assert (variables["MASTER_ADDR"], variables["MASTER_PORT"]) == ("10.1.2.3", "4567")


@pytest.mark.parametrize(
    "variables",
    [
        {"RANK": "0"},
        {"WORLD_SIZE": "4"},
        {"LOCAL_RANK": "1"},  # torchrun / accel launch chose already
        {"SLURM_STEP_NUM_TASKS": None},  # sbatch's batch script or salloc's shell: no srun step
        {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},  # `srun --pty bash`: one task
    ],
)
def test_no_srun_step_of_several_tasks_means_no_variables(variables):
    assert slurm.task_environment(step(**variables)) is None


@pytest.mark.parametrize(
    "variables,message",
    [
        ({"SLURM_PROCID": None}, "SLURM_PROCID is not set, though srun started this process"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x': not an integer"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"),
        ({"SLURM_STEP_NUM_TASKS": "-2"}, "SLURM_STEP_NUM_TASKS='-2': must be at least 1"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 on node SLURM_NODEID=1 does not fit SLURM_STEP_TASKS_PER_NODE="),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below SLURM_STEP_NUM_NODES=2"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x2"}, "SLURM_STEP_TASKS_PER_NODE='2(x2': '2(x2' is not a task count"),
        ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "SLURM_STEP_NODELIST='gpu[07-08': not a Slurm host list"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc': not an integer"),
    ],
)
def test_bad_slurm_values_are_errors_naming_the_variable(variables, message):
    with pytest.raises(slurm.SlurmError) as raised:
        slurm.task_environment(step(**variables))
    assert message in str(raised.value)


@pytest.fixture
def no_launcher(monkeypatch):
    """The test process as srun would start it: no launcher's variables, whatever the shell running pytest set."""
    for name in TORCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_a_script_in_an_interactive_srun_shell_stays_one_process(no_launcher):
    # `srun --pty bash`, then `python x.py`: a step of one task.
    for name, value in {
        "SLURM_JOB_ID": "51",
        "SLURM_JOB_NAME": "bash",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "node01",
        "SLURM_STEP_TASKS_PER_NODE": "1",
    }.items():
        no_launcher.setenv(name, value)
    state = PartialState(cpu=True)
    assert (state.distributed_type, state.num_processes, state.backend) == (DistributedType.NO, 1, None)
    assert not [name for name in TORCH_VARIABLES if name in os.environ]


def test_a_script_run_straight_in_a_batch_script_stays_one_process(no_launcher):
    # `#SBATCH --ntasks=4`, then `python x.py` without srun: the batch script sees the allocation's tasks.
    for name, value in {
        "SLURM_JOB_ID": "52",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
    }.items():
        no_launcher.setenv(name, value)
    state = PartialState(cpu=True)
    assert (state.distributed_type, state.num_processes) == (DistributedType.NO, 1)
    assert not [name for name in TORCH_VARIABLES if name in os.environ]


def test_a_bad_slurm_value_stops_the_state_naming_it(no_launcher):
    for name, value in step(SLURM_PROCID="one").items():
        no_launcher.setenv(name, value)
    with pytest.raises(slurm.SlurmError, match="SLURM_PROCID='one': not an integer"):
        PartialState(cpu=True)
    assert not PartialState._shared_state and not [name for name in TORCH_VARIABLES if name in os.environ]


# --- a real two-task step --------------------------------------------------------------------------------------------

_TASK_SCRIPT = """
    import json, os
    import torch
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    total = accelerator.reduce(torch.tensor([rank + 1.0]), "sum")
    ranks = accelerator.gather(torch.tensor([rank * 10]))
    print(json.dumps({
        "type": accelerator.distributed_type.value, "index": rank, "local": accelerator.local_process_index,
        "processes": accelerator.num_processes, "sum": total.item(), "gathered": ranks.tolist(),
        "addr": os.environ["MASTER_ADDR"], "port": os.environ["MASTER_PORT"],
        "local_world": os.environ["LOCAL_WORLD_SIZE"]}), flush=True)
    accelerator.end_training()
"""


def _free_job_id() -> str:
    """A job id whose port (accel.slurm.job_port) nothing listens on now, on 127.0.0.1."""
    for job_id in range(os.getpid() % 10000, os.getpid() % 10000 + 10000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", slurm.job_port({"SLURM_JOB_ID": str(job_id)})))
            except OSError:
                continue
        return str(job_id)
    raise RuntimeError("no free port in the job ports' range")


def _task_env(procid: int, job_id: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ACCEL_", "ACCELERATE_", "SLURM_")) and name not in TORCH_VARIABLES
    }
    if "ACCEL_DISABLE_NATIVE" in os.environ:  # keep the suite's native/fallback mode
        env["ACCEL_DISABLE_NATIVE"] = os.environ["ACCEL_DISABLE_NATIVE"]
    env.update(
        SLURM_JOB_ID=job_id,
        SLURM_STEP_ID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_NTASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_NNODES="1",
        SLURM_STEP_NODELIST="127.0.0.1",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_NODEID="0",
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(procid),
        ACCEL_PROCESS_GROUP_TIMEOUT="60",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.mark.timeout(180)
def test_two_srun_tasks_without_a_launcher_form_one_job(tmp_path):
    script = tmp_path / "task.py"
    script.write_text(textwrap.dedent(_TASK_SCRIPT))
    job_id = _free_job_id()
    tasks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=_task_env(procid, job_id),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for procid in range(2)
    ]
    try:
        outputs = [task.communicate(timeout=120) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
            task.wait()
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(err for _, err in outputs)
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    port = str(slurm.job_port({"SLURM_JOB_ID": job_id}))
    for procid, report in enumerate(reports):
        assert report == {
            "type": "MULTI_CPU",
            "index": procid,
            "local": procid,
            "processes": 2,
            "sum": 3.0,
            "gathered": [0, 10],
            "addr": "127.0.0.1",
            "port": port,
            "local_world": "2",
        }
