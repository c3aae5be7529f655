"""A save in the default mode changes no directory entry after it returns (accel.checkpoint.background): what the
background does later (fsync, the durability record rewritten in place, freeing the blocks of removed files)
changes file contents only. A user who removes, moves or lists the folder right after the call sees what the call
left, as after HF's save. Rotation happens inside the calls the user makes (a save, load_state,
wait_for_checkpoint, end_training), never behind their back."""

import os
import random
import shutil
import tempfile
import threading
import time

import pytest
import torch

from accel.accelerator import Accelerator
from accel.accelerator_config import ProjectConfiguration
from accel.checkpoint import background, durability
from accel.checkpoint.names import DURABILITY_RECORD
from accel.state import AcceleratorState, GradientState


def fresh_accelerator(**kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def prepared(accelerator, width=32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def listing(folder):
    """Every entry under `folder` (hidden ones too), with its inode: a name removed and made again differs."""
    entries = {}
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(parent, name)
            entries[os.path.relpath(path, folder)] = os.lstat(path).st_ino
    return entries


def open_descriptors():
    return set(os.listdir("/proc/self/fd"))


def held_deleted_files(folder):
    """The descriptors this process holds on files of `folder` that were removed (their blocks not freed yet)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)) and target.endswith(" (deleted)"):
            held.append(target)
    return held


def worker_finished():
    """Waits until the worker ran everything queued, without a join (a join is where rotation may happen)."""
    deadline = time.monotonic() + 60
    while background.saves.busy():
        assert time.monotonic() < deadline, "the background worker did not finish"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _idle_worker_around_each_test():
    try:
        background.saves.join()
    except RuntimeError:
        pass
    yield
    try:
        background.saves.join()
    except RuntimeError:
        pass


@pytest.fixture
def held_worker():
    """The background worker held busy until the test sets the event (released at teardown in any case)."""
    gate = threading.Event()
    background.saves.submit(gate.wait, "a test holding the worker")
    yield gate
    gate.set()
    worker_finished()


@pytest.fixture
def slow_worker(monkeypatch):
    """The background worker's fsyncs take a random extra 0-0.5 ms, the test's own unlinks 0-3 ms: the worker's
    work overlaps the test's removal of the folder it just saved, at ever different moments."""
    generator = random.Random(0)
    real_fsync, real_unlink = os.fsync, os.unlink

    def slow_fsync(fd):
        if threading.current_thread().name.startswith("accel-checkpoint"):
            time.sleep(generator.uniform(0, 0.0005))
        real_fsync(fd)

    def slow_unlink(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            time.sleep(generator.uniform(0, 0.003))
        real_unlink(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(os, "unlink", slow_unlink)


def test_a_folder_removed_right_after_save_state_stays_removed(tmp_path, slow_worker):
    accelerator = fresh_accelerator()
    prepared(accelerator)
    before = open_descriptors()
    for i in range(100):
        with tempfile.TemporaryDirectory(dir=tmp_path) as folder:  # exists: the save swaps it out
            accelerator.save_state(folder)
        folder = str(tmp_path / f"new{i}")  # does not exist: the save creates it
        accelerator.save_state(folder)
        shutil.rmtree(folder)
    accelerator.wait_for_checkpoint()  # nothing failed in the background
    assert os.listdir(tmp_path) == []  # nothing recreated, nothing hidden left behind
    assert open_descriptors() == before


def test_the_worker_finishing_in_the_middle_of_a_removal_changes_nothing(tmp_path, held_worker, monkeypatch):
    accelerator = fresh_accelerator()
    prepared(accelerator)
    folder = str(tmp_path / "ckpt")
    accelerator.save_state(folder)
    real_rmdir = os.rmdir

    def worker_runs_first(*args, **kwargs):  # the worst moment: the files are unlinked, the folder not yet
        held_worker.set()
        worker_finished()
        real_rmdir(*args, **kwargs)

    monkeypatch.setattr(os, "rmdir", worker_runs_first)
    shutil.rmtree(folder)
    monkeypatch.undo()
    accelerator.wait_for_checkpoint()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "replaced-folder"])
def test_save_state_listing_does_not_change_when_durability_completes(tmp_path, held_worker, existing):
    accelerator = fresh_accelerator()
    prepared(accelerator)
    folder = str(tmp_path / "ckpt")
    if existing:
        accelerator.save_state(folder)
    on_return = accelerator.save_state(folder)
    assert on_return == folder
    seen = listing(tmp_path)
    assert durability.durability_of(folder) == "this-boot"
    held_worker.set()
    worker_finished()
    assert listing(tmp_path) == seen
    assert durability.durability_of(folder) == "durable"


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "replaced-folder"])
def test_save_model_listing_does_not_change_when_the_background_finishes(tmp_path, held_worker, existing):
    accelerator = fresh_accelerator()
    model, _ = prepared(accelerator, width=256)
    folder = str(tmp_path / "out")
    if existing:
        accelerator.save_model(model, folder, max_shard_size="100KB")
    accelerator.save_model(model, folder, max_shard_size="100KB")
    seen = listing(tmp_path)
    held_worker.set()
    worker_finished()
    assert listing(tmp_path) == seen


def test_a_folder_with_other_content_is_made_durable_where_its_files_went(tmp_path, held_worker):
    accelerator = fresh_accelerator()
    prepared(accelerator)
    (tmp_path / "logs.txt").write_text("the user's")  # the files are moved in one by one, not the folder swapped
    accelerator.save_state(str(tmp_path))
    seen = listing(tmp_path)
    assert durability.durability_of(str(tmp_path)) == "this-boot"
    held_worker.set()
    worker_finished()
    assert listing(tmp_path) == seen
    assert durability.durability_of(str(tmp_path)) == "durable"


def test_replaced_save_model_files_are_gone_on_return_and_their_blocks_freed_later(tmp_path, held_worker):
    accelerator = fresh_accelerator()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])  # 4 x 1 MiB
    folder = tmp_path / "out"
    before = open_descriptors()
    accelerator.save_model(model, str(folder), max_shard_size="1100KB")  # four shards and an index
    assert len(os.listdir(folder)) == 5
    accelerator.save_model(model, str(folder))  # one file: every earlier name goes
    assert os.listdir(folder) == ["model.safetensors"]
    assert len(held_deleted_files(folder)) == 4  # unlinked; freeing their blocks is left to the worker
    held_worker.set()
    accelerator.wait_for_checkpoint()
    assert held_deleted_files(folder) == []
    assert open_descriptors() == before
    assert os.listdir(folder) == ["model.safetensors"]


def test_a_folder_replaced_by_the_user_before_durability_completes_is_left_alone(tmp_path, held_worker):
    accelerator = fresh_accelerator()
    prepared(accelerator)
    folder = tmp_path / "ckpt"
    accelerator.save_state(str(folder))
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / "mine.txt").write_text("the user's")
    held_worker.set()
    accelerator.wait_for_checkpoint()
    assert os.listdir(folder) == ["mine.txt"]
    assert durability.durability_of(str(folder)) == "unknown"


def numbered(tmp_path):
    return sorted(os.listdir(tmp_path / "checkpoints"))


@pytest.mark.parametrize("join_point", ["save_state", "load_state", "wait_for_checkpoint", "end_training"])
def test_rotation_waits_for_a_join_point_the_user_calls(tmp_path, held_worker, join_point):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    accelerator = fresh_accelerator(project_config=config)
    model, _ = prepared(accelerator)
    accelerator.save_state(durable=True)  # checkpoint_0
    accelerator.save_state()  # checkpoint_1: not durable while the worker is held, so checkpoint_0 stays
    assert numbered(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    held_worker.set()
    worker_finished()
    assert durability.durability_of(str(tmp_path / "checkpoints" / "checkpoint_1")) == "durable"
    assert numbered(tmp_path) == ["checkpoint_0", "checkpoint_1"]  # the worker removes nothing
    if join_point == "save_state":
        accelerator.save_state()  # checkpoint_2; checkpoint_1, durable, is kept until checkpoint_2 is
        assert "checkpoint_0" not in numbered(tmp_path)
    else:
        getattr(accelerator, join_point)()
        assert numbered(tmp_path) == ["checkpoint_1"]


def test_the_record_says_which_durability_a_folder_has(tmp_path):
    record = tmp_path / DURABILITY_RECORD
    assert durability.durability_of(str(tmp_path)) == "unknown"  # HF's folders have none
    here = durability.boot_identity()
    for content, expected in [
        (f"unsynced {here}\n", "this-boot"),
        ("unsynced another-host another-boot\n", "lost-boot"),
        (f"durable {here}\n", "durable"),
        (f"durable {here}\n\n", "durable"),  # rewritten, not truncated yet
        (f"durabled {here}\n", "unknown"),  # read half rewritten: by then everything else is on disk
        ("", "unknown"),
    ]:
        record.write_text(content)
        assert durability.durability_of(str(tmp_path)) == expected, content
    record.write_bytes(b"\xff\xfe")
    assert durability.durability_of(str(tmp_path)) == "unknown"


def big_files(folder, count):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"f{i}.bin").write_bytes(os.urandom(1 << 20))


def test_at_most_the_budget_of_removed_files_is_held_open(tmp_path, held_worker, monkeypatch):
    from accel.checkpoint.atomic_files import UnlinkedFiles

    monkeypatch.setattr(UnlinkedFiles, "_budget", UnlinkedFiles._held_in_process + 2)
    big_files(tmp_path / "a", 4)
    (tmp_path / "a" / "small").write_bytes(b"x")
    before = open_descriptors()
    background.remove_tree_now_free_later(str(tmp_path / "a"))
    assert os.listdir(tmp_path) == []
    assert len(held_deleted_files(tmp_path)) == 2  # the other two were freed at once
    held_worker.set()
    worker_finished()
    assert open_descriptors() == before


def test_a_removal_that_fails_midway_still_frees_what_it_held(tmp_path, held_worker, monkeypatch):
    big_files(tmp_path / "a" / "sub", 2)
    real_rmdir = os.rmdir

    def failing_rmdir(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    before = open_descriptors()
    monkeypatch.setattr(os, "rmdir", failing_rmdir)
    with pytest.raises(PermissionError):
        background.remove_tree_now_free_later(str(tmp_path / "a"))
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    assert os.listdir(tmp_path / "a" / "sub") == [] and len(held_deleted_files(tmp_path)) == 2
    held_worker.set()
    worker_finished()
    assert open_descriptors() == before


ENDS_WITHOUT_END_TRAINING = """
import os, sys, time, torch
from accel.accelerator import Accelerator
from accel.checkpoint import background
from accel.accelerator_config import ProjectConfiguration

config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=1)
accelerator = Accelerator(project_config=config)
accelerator.prepare(torch.nn.Linear(4, 4))
accelerator.save_state(durable=True)
background.saves.submit(lambda: time.sleep(0.5), "a slow disk")
accelerator.save_state()
print(" ".join(sorted(os.listdir(os.path.join(sys.argv[1], "checkpoints")))))
"""


def test_a_script_that_ends_without_end_training_is_rotated_at_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(ENDS_WITHOUT_END_TRAINING)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["checkpoint_0", "checkpoint_1"]  # checkpoint_1 was not durable yet
    assert numbered(tmp_path) == ["checkpoint_1"]
    assert durability.durability_of(str(tmp_path / "checkpoints" / "checkpoint_1")) == "durable"
