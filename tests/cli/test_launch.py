"""`accel launch`: settings resolution, the hand-off to torch.distributed.run, and real multi-process runs."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from accel.cli.config_file import ConfigError
from accel.cli.launch import LaunchConfig, LaunchError, child_env, flags_from_args, resolve, torchrun_argv
from accel.cli.main import build_parser

RANK_SCRIPT = """
    import os, sys
    from accel.state import PartialState
    state = PartialState()
    line = (f"rank {state.process_index}/{state.num_processes} {state.distributed_type.value} "
            f"mp={os.environ['ACCEL_MIXED_PRECISION']} args={sys.argv[1:]}\\n")
    os.write(1, line.encode())  # one write per line: ranks share the pipe
    state.wait_for_everyone()
    state.destroy_process_group()
"""


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def isolated_env(tmp_path, **extra):
    """The child's env: no config file from the real home, no ACCEL_* settings from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    # TMPDIR: a launcher killed on purpose cannot remove its temporary log folder; pytest removes tmp_path.
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), TMPDIR=str(tmp_path), **extra)
    for name in ("ACCEL_DISABLE_NATIVE",):  # keep the suite's native/fallback mode
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def accel(tmp_path, *args, timeout=120, env=None):
    return subprocess.run(
        [sys.executable, "-m", "accel", *args],
        cwd=tmp_path,
        env=env or isolated_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_launchers(tmp_path, command, envs, timeout=180):
    """Runs `command` once per environment in `envs` at the same time (launchers of one job on several faked
    machines), kills any still running after `timeout`, and returns [(exit status, stdout, stderr)] in order."""
    launchers = [
        subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]
    try:
        outputs = [launcher.communicate(timeout=timeout) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
            launcher.wait()
    return [(launcher.returncode, out, err) for launcher, (out, err) in zip(launchers, outputs)]


def launch_flags(*argv):
    return flags_from_args(build_parser().parse_args(["launch", *argv]))


# --- resolution: config file < ACCEL_* env < flags -------------------------------------------------


def test_flags_override_env_which_overrides_the_config_file(tmp_path):
    config = write(tmp_path / "c.yaml", "distributed_type: MULTI_CPU\nnum_processes: 3\nmixed_precision: bf16\n")
    flags = launch_flags("--config_file", str(config), "--num_processes", "2", "train.py")
    resolved = resolve(flags, environ={"ACCEL_MIXED_PRECISION": "fp16", "ACCEL_NUM_PROCESSES": "4"})
    assert (resolved.num_processes, resolved.mixed_precision, resolved.use_cpu) == (2, "fp16", True)


def test_dash_and_underscore_spellings_are_the_same_flag():
    dashed = launch_flags("--num-processes", "2", "--mixed-precision", "bf16", "--dynamo-backend", "inductor", "t.py")
    underscored = launch_flags(
        "--num_processes", "2", "--mixed_precision", "bf16", "--dynamo_backend", "inductor", "t.py"
    )
    assert dashed == underscored


def test_script_arguments_are_passed_through_untouched():
    flags = launch_flags("--cpu", "train.py", "--num_processes", "9", "-m", "x")
    assert flags["training_script"] == "train.py"
    assert flags["training_script_args"] == ("--num_processes", "9", "-m", "x")
    assert flags["num_processes"] is None


@pytest.mark.parametrize(
    "argv,environ,message",
    [
        (["--mixed_precision", "fp12"], {}, "mixed_precision='fp12': expected one of no, fp16, bf16, fp8"),
        (["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "3"], {}, "must divide evenly"),
        (["--num_machines", "2"], {}, "needs main_process_ip"),
        (["--module", "--no_python"], {}, "cannot be used together"),
        ([], {"ACCEL_NUM_PROCESSES": "two"}, "ACCEL_NUM_PROCESSES: 'two' is not an int"),
        ([], {"ACCEL_USE_CPU": "maybe"}, "ACCEL_USE_CPU: 'maybe' is not a boolean"),
        (["--dynamo_backend", "turbo"], {}, "dynamo_backend='TURBO': expected one of NO, EAGER"),
        (["--dynamo_mode", "fast"], {}, "dynamo_mode='fast': expected one of default, reduce-overhead"),
    ],
)
def test_bad_settings_name_the_setting(argv, environ, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(launch_flags(*argv, "train.py"), environ=environ)


def test_a_bad_config_file_is_reported_with_its_path(tmp_path):
    config = write(tmp_path / "c.yaml", "num_processes: two\n")
    with pytest.raises(ConfigError, match="c.yaml"):
        resolve(launch_flags("--config_file", str(config), "train.py"), environ={})


# --- the hand-off to torch.distributed.run -----------------------------------------------------------


def test_booleans_read_like_everywhere_else_in_accel():
    assert resolve(launch_flags("train.py"), environ={"ACCEL_USE_CPU": "on", "ACCEL_DEBUG_MODE": "Yes"}).debug


def test_one_machine_without_a_port_picks_a_free_one():
    argv = torchrun_argv(
        LaunchConfig(use_cpu=True, num_processes=2, main_process_ip="10.9.9.9", training_script="t.py")
    )
    assert "--standalone" in argv and argv[argv.index("--nproc_per_node") + 1] == "2"
    assert "10.9.9.9" not in argv  # as HF: main_process_ip only matters with several machines
    assert argv[-3:] == ["-m", "accel.cli.worker", "t.py"]


def test_multi_machine_num_processes_is_the_total():
    config = LaunchConfig(
        num_processes=8,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=1234,
        training_script="t.py",
    )
    argv = torchrun_argv(config)
    assert argv[argv.index("--nproc_per_node") + 1] == "4" and argv[argv.index("--node_rank") + 1] == "1"
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.1" and argv[argv.index("--master_port") + 1] == "1234"


def test_machines_on_different_networks_use_a_rendezvous_endpoint():
    config = LaunchConfig(
        num_processes=2,
        num_machines=2,
        main_process_ip="h",
        same_network=False,
        rdzv_backend="c10d",
        training_script="t.py",
    )
    argv = torchrun_argv(config)
    assert argv[argv.index("--rdzv_endpoint") + 1] == "h:29500" and argv[argv.index("--rdzv_backend") + 1] == "c10d"


def test_module_and_no_python_targets():
    module = torchrun_argv(LaunchConfig(module=True, training_script="pkg.train", training_script_args=("a",)))
    assert module[-4:] == ["accel.cli.worker", "-m", "pkg.train", "a"]
    exe = torchrun_argv(LaunchConfig(no_python=True, training_script="./run.sh"))
    assert exe[-4:] == ["-m", "accel.cli.worker", "--exec", "./run.sh"]  # the worker sets the death signal, then execs


def test_children_get_the_settings_the_accelerator_reads():
    env = child_env(
        LaunchConfig(
            use_cpu=True,
            num_processes=2,
            mixed_precision="bf16",
            debug=True,
            dynamo_backend="INDUCTOR",
            gradient_accumulation_steps=4,
        ),
        environ={},
    )
    assert env["ACCEL_MIXED_PRECISION"] == "bf16" and env["ACCEL_DEBUG_MODE"] == "true"
    assert env["ACCEL_DYNAMO_BACKEND"] == "INDUCTOR" and env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert int(env["OMP_NUM_THREADS"]) == max(1, os.cpu_count() // 2)


def test_ipex_asked_for_but_missing_warns_and_runs_without(monkeypatch):
    monkeypatch.setattr("accel.availability.is_ipex_available", lambda: False)
    with pytest.warns(UserWarning, match="intel_extension_for_pytorch is not installed"):
        env = child_env(LaunchConfig(use_cpu=True, ipex=True), environ={})
    assert "ACCEL_USE_IPEX" not in env


# --- real launches of the installed CLI ---------------------------------------------------------------


@pytest.mark.slow
def test_cpu_num_processes_2_starts_two_ranks(tmp_path):
    script = write(tmp_path / "ranks.py", RANK_SCRIPT)
    result = accel(
        tmp_path, "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "bf16", str(script), "--lr", "1"
    )
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r}/2 MULTI_CPU mp=bf16 args=['--lr', '1']" for r in range(2)]


@pytest.mark.slow
def test_module_target_runs_with_python_m(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package / "train.py", RANK_SCRIPT)
    result = accel(tmp_path, "launch", "--cpu", "--num_processes", "2", "-m", "mypkg.train", "x")
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))[1].endswith("args=['x']")


@pytest.mark.slow
def test_no_python_runs_an_executable(tmp_path):
    script = write(tmp_path / "run.sh", '#!/bin/sh\nprintf "worker $RANK of $WORLD_SIZE\\n"\n')
    script.chmod(0o755)
    result = accel(tmp_path, "launch", "--cpu", "--num_processes", "2", "--no_python", str(script))
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("worker")) == [
        "worker 0 of 2",
        "worker 1 of 2",
    ]


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_its_traceback_and_no_orphans(tmp_path):
    script = write(
        tmp_path / "fail.py",
        f"""
        import os, time
        from accel.state import PartialState
        state = PartialState()
        open(os.path.join({str(tmp_path)!r}, f"pid{{state.process_index}}"), "w").write(str(os.getpid()))
        if state.process_index == 1:
            raise ValueError("rank one failed on purpose")
        time.sleep(120)  # rank 0 would wait for ever if the launcher did not stop it
    """,
    )
    start = time.monotonic()
    result = accel(tmp_path, "launch", "--cpu", "--num_processes", "2", str(script), timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "ValueError: rank one failed on purpose" in result.stderr
    assert "rank      : 1" in result.stderr  # the launcher's summary names the failing rank
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop after a rank failed"
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_two_launchers_on_localhost_form_one_job(tmp_path):
    script = write(tmp_path / "ranks.py", RANK_SCRIPT)
    port = str(free_port())
    common = [
        "launch",
        "--cpu",
        "--num_machines",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
        "--num_processes",
        "4",
    ]
    env = isolated_env(tmp_path)
    command = [sys.executable, "-m", "accel"]
    second = subprocess.Popen(
        [*command, *common, "--machine_rank", "1", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = subprocess.run(
            [*command, *common, "--machine_rank", "0", str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out, err = second.communicate(timeout=60)
    finally:
        second.kill()
        second.wait()
    assert first.returncode == 0 and second.returncode == 0, first.stderr + err
    ranks = [line.split()[1] for line in (first.stdout + out).splitlines() if line.startswith("rank")]
    assert sorted(ranks) == ["0/4", "1/4", "2/4", "3/4"]


@pytest.mark.slow
def test_the_default_config_file_sets_the_processes(tmp_path):
    config_dir = tmp_path / "cache" / "accel"
    config_dir.mkdir(parents=True)
    write(config_dir / "default_config.yaml", "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\n")
    script = write(tmp_path / "ranks.py", RANK_SCRIPT)
    result = accel(tmp_path, "launch", str(script))
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.startswith("rank") and "mp=fp16" in line]) == 2


@pytest.mark.parametrize("flag", ["--num_procs", "--num_proc"])  # unknown, and an abbreviation argparse would guess
def test_an_unknown_flag_is_an_error_naming_it(tmp_path, flag):
    result = accel(tmp_path, "launch", flag, "2", "train.py")
    assert result.returncode == 2 and f"unrecognized arguments: {flag}" in result.stderr


def test_a_bad_setting_exits_2_with_the_message(tmp_path):
    result = accel(tmp_path, "launch", "--mixed_precision", "fp12", "train.py")
    assert result.returncode == 2 and "mixed_precision='fp12'" in result.stderr


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    script = write(
        tmp_path / "sleeper.py",
        f"""
        import os, time
        open(os.path.join({str(tmp_path)!r}, f"pid{{os.environ['RANK']}}"), "w").write(str(os.getpid()))
        time.sleep(120)
    """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accel", "launch", "--cpu", "--num_processes", "2", str(script)],
        cwd=tmp_path,
        env=isolated_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    finally:
        launcher.kill()  # SIGKILL: the launcher gets no chance to stop its ranks
        launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    survivors = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for pid in survivors:
        os.kill(pid, 9)
    assert not survivors, "ranks outlived their launcher"
