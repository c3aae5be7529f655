"""`accel launch` gives ranks that train on CPUs glibc malloc settings that keep freed buffers for reuse
(accel/cli/cpu_malloc.py): when it sets them, what of the user's it keeps, and that glibc applies them in the ranks."""

import subprocess
import sys
import textwrap

import pytest
from test_launch import isolated_env

from accel.cli import cpu_malloc
from accel.cli.launch import child_env, flags_from_args, resolve
from accel.cli.main import build_parser, main

OURS = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"

# Where glibc puts a 24 MiB block: a mapping of its own (glibc's start: mmap threshold 128 KiB) or the heap, and
# whether the heap keeps it once freed (mallinfo2: bytes in mappings, bytes of the heap).
MALLOC_PROBE = """
    import ctypes, torch

    FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2()
    block = torch.ones(6 << 20)
    held = libc.mallinfo2()
    del block
    after = libc.mallinfo2()
    print("block", (held.hblkhd - before.hblkhd) >> 20, (after.arena - before.arena) >> 20, flush=True)
"""


def launch_env(*argv, environ=None, cuda=False, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    config = resolve(flags_from_args(build_parser().parse_args(["launch", *argv, "train.py"])), environ={})
    return child_env(config, environ=environ or {})


def test_cpu_ranks_get_the_settings(monkeypatch):
    assert launch_env("--cpu", monkeypatch=monkeypatch)["GLIBC_TUNABLES"] == OURS
    # No --cpu, but no CUDA device either: the ranks train on CPUs all the same.
    assert launch_env("--num_processes", "2", monkeypatch=monkeypatch)["GLIBC_TUNABLES"] == OURS


def test_gpu_ranks_are_left_alone(monkeypatch):
    assert "GLIBC_TUNABLES" not in launch_env("--num_processes", "2", cuda=True, monkeypatch=monkeypatch)
    assert "GLIBC_TUNABLES" in launch_env("--cpu", cuda=True, monkeypatch=monkeypatch)


@pytest.mark.parametrize("switch", ["0", "false", "NO", " off "])
def test_the_switch_turns_them_off(switch):
    assert cpu_malloc.malloc_env(True, {cpu_malloc.SWITCH: switch}) == {}
    assert cpu_malloc.malloc_env(True, {cpu_malloc.SWITCH: "1"}) == {"GLIBC_TUNABLES": OURS}


def test_a_switch_that_is_not_a_boolean_is_an_error():
    with pytest.raises(ValueError, match="ACCEL_CPU_MALLOC_TUNING: 'maybe' is not a boolean"):
        cpu_malloc.malloc_env(True, {cpu_malloc.SWITCH: "maybe"})


def test_the_users_own_tunables_are_kept():
    other = "glibc.pthread.rseq=0"
    assert cpu_malloc.malloc_env(True, {"GLIBC_TUNABLES": other}) == {"GLIBC_TUNABLES": f"{other}:{OURS}"}


@pytest.mark.parametrize(
    "environ",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
        {"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=0"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
    ],
)
def test_a_threshold_the_user_chose_wins(environ):
    assert cpu_malloc.malloc_env(True, environ) == {}


def test_a_bad_switch_stops_the_launch_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cpu_malloc.SWITCH, "maybe")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    assert main(["launch", "--cpu", "train.py"]) == 2
    assert "ACCEL_CPU_MALLOC_TUNING: 'maybe' is not a boolean" in capsys.readouterr().err


def where_the_block_goes(command, tmp_path, env):
    """[(MiB of the block in a mapping of its own, MiB the heap kept after it was freed)], one per process."""
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [tuple(map(int, line.split()[1:])) for line in result.stdout.splitlines() if line.startswith("block")]


def test_glibc_applies_them_in_the_launched_ranks(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(MALLOC_PROBE))
    env = isolated_env(tmp_path)
    env.pop("GLIBC_TUNABLES", None)
    # The probe can tell: glibc on its own maps the block and unmaps it when freed.
    assert where_the_block_goes([sys.executable, str(script)], tmp_path, env) == [(24, 0)]
    launched = [sys.executable, "-m", "accel", "launch", "--cpu", "--num_processes", "2", str(script)]
    assert where_the_block_goes(launched, tmp_path, env) == [(0, 24), (0, 24)]
