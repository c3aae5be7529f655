"""`accel env` and `accel test` through the installed CLI, and the seed's flow: config → launch/env/test."""

import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from accel import _ext

SEED_ANSWERS = ["This machine", "multi-CPU", "1", "no", "no", "no", "2", "fp16"]


def cli_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), TMPDIR=str(tmp_path), **extra)
    if "ACCEL_DISABLE_NATIVE" in os.environ:
        env.setdefault("ACCEL_DISABLE_NATIVE", os.environ["ACCEL_DISABLE_NATIVE"])
    return env


def accel(tmp_path, *args, stdin=None, timeout=180, **extra_env):
    return subprocess.run(
        [sys.executable, "-m", "accel", *args],
        cwd=tmp_path,
        env=cli_env(tmp_path, **extra_env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_env_reports_the_native_kernels_as_this_process_sees_them(tmp_path):
    result = accel(tmp_path, "env")
    assert result.returncode == 0, result.stderr
    if _ext.status().loaded:
        assert "- accel native kernels: loaded" in result.stdout
        assert f"native build: torch {_ext.status().build_info['torch']}" in result.stdout
    else:
        assert "- accel native kernels: NOT loaded" in result.stdout
        assert f"- why not loaded: {_ext.status().reason}" in result.stdout and "- how to fix:" in result.stdout
    for fact in ("`accel` version", "Python version", "Numpy version", "PyTorch version", "System RAM", "CUDA kernels"):
        assert f"- {fact}:" in result.stdout


def test_env_says_why_native_is_off(tmp_path):
    result = accel(tmp_path, "env", ACCEL_DISABLE_NATIVE="1")
    assert "- accel native kernels: NOT loaded" in result.stdout
    assert "- why not loaded: disabled by ACCEL_DISABLE_NATIVE=1" in result.stdout
    assert "- shared-memory transport: off (needs the native kernels)" in result.stdout


def test_env_reports_the_transport_setting(tmp_path):
    result = accel(tmp_path, "env", ACCEL_TRANSPORT="torch")
    assert "- shared-memory transport: off (ACCEL_TRANSPORT=torch)" in result.stdout
    result = accel(tmp_path, "env", ACCEL_TRANSPORT="tcp")
    assert "- shared-memory transport: misconfigured: ACCEL_TRANSPORT='tcp'" in result.stdout
    if _ext.status().loaded:
        assert "- shared-memory transport: ACCEL_TRANSPORT=auto, " in accel(tmp_path, "env").stdout


def test_env_shows_the_config_and_names_a_bad_one(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n")
    result = accel(tmp_path, "env", "--config_file", str(good))
    assert "\t- distributed_type: MULTI_CPU" in result.stdout and "\t- mixed_precision: bf16" in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_CPU\nnum_procs: 2\n")
    result = accel(tmp_path, "env", "--config_file", str(bad))
    assert result.returncode == 0 and "unusable" in result.stdout and "num_procs" in result.stdout


@pytest.mark.slow
def test_seed_flow_config_then_launch_env_and_test(tmp_path):
    """`accel config` fed the seed's answers writes the YAML that launch, env and test then use."""
    configured = accel(tmp_path, "config", stdin="\n".join(SEED_ANSWERS) + "\n")
    assert configured.returncode == 0, configured.stdout + configured.stderr
    path = tmp_path / "cache" / "accel" / "default_config.yaml"
    assert f"accel configuration saved at {path}" in configured.stdout
    assert yaml.safe_load(path.read_text())["num_processes"] == 2

    env = accel(tmp_path, "env")
    assert f"`accel` config ({path})" in env.stdout and "\t- distributed_type: MULTI_CPU" in env.stdout

    script = tmp_path / "world.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from accel.state import PartialState
        state = PartialState()
        mixed_precision = os.environ['ACCEL_MIXED_PRECISION']
        os.write(1, f"rank {state.process_index} of {state.num_processes} {mixed_precision}\\n".encode())
        state.destroy_process_group()
    """)
    )
    launched = accel(tmp_path, "launch", str(script))
    assert launched.returncode == 0, launched.stderr
    assert sorted(line for line in launched.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 of 2 fp16",
        "rank 1 of 2 fp16",
    ]

    tested = accel(tmp_path, "test")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "accel test: 2 process(es), DistributedType.MULTI_CPU" in tested.stdout
    assert tested.stdout.strip().endswith("Test is a success! You are ready for your distributed training!")


@pytest.mark.slow
def test_accel_test_names_the_check_that_failed(tmp_path):
    # The real checks.main with one check that fails on rank 1 only: the job must fail and name it.
    script = tmp_path / "failing_checks.py"
    script.write_text(
        textwrap.dedent("""
        from accel.cli import checks

        def check_rank_one_disagrees(state):
            assert state.process_index != 1, "rank 1 sees something else"

        checks.CHECKS.append(("ranks agree", check_rank_one_disagrees))
        checks.main()
    """)
    )
    result = accel(tmp_path, "launch", "--cpu", "--num_processes", "2", str(script))
    assert result.returncode != 0
    assert "accel test: check 'ranks agree' failed on rank 1: rank 1 sees something else" in result.stderr
