"""The three save modes (issue 13, point 3; accel.checkpoint.background): default (complete on return, durable in
the background, then recorded so), durable (fsync'd on return), asynchronous (snapshot on return, written in the
background, joined later, failures raised at the join); load_state() never picks a checkpoint whose durability
did not complete before a restart when an older durable one exists; save_model publishes its files together."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from accel.accelerator import Accelerator
from accel.accelerator_config import ProjectConfiguration
from accel.checkpoint import background, durability, load_checkpoint_in_model, model_io, publish_journal, snapshot
from accel.checkpoint.background import SaveMode
from accel.checkpoint.names import DURABILITY_RECORD, PUBLISH_JOURNAL
from accel.state import AcceleratorState, GradientState


def fresh_accelerator(**kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def prepared(accelerator, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def step(model, optimizer):
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _idle_worker():
    try:
        background.saves.join()
    except RuntimeError:  # a failure another test provoked and checked
        pass


@pytest.fixture(autouse=True)
def _no_background_work_across_tests():
    """Each test starts and ends with an idle worker (the fsyncs a test counts are its own)."""
    _idle_worker()
    yield
    _idle_worker()


@pytest.fixture
def fsynced(monkeypatch):
    """The paths os.fsync was called on (through their descriptors), in order."""
    calls = []
    real = os.fsync

    def recording_fsync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


@pytest.fixture
def held_worker():
    """Holds the background worker busy until released: durability cannot complete meanwhile."""
    gate = threading.Event()
    background.saves.submit(gate.wait, "a test holding the worker")
    yield gate
    gate.set()
    background.saves.join()


def test_default_save_state_returns_complete_files_and_is_made_durable_in_the_background(tmp_path, fsynced):
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    gate = threading.Event()
    background.saves.submit(gate.wait, "hold")
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    assert fsynced == []  # nothing waited for the disk
    assert {"model.safetensors", "optimizer.bin", DURABILITY_RECORD} <= set(os.listdir(folder))
    assert durability.durability_of(folder) == "this-boot"
    gate.set()
    accelerator.wait_for_checkpoint()
    assert durability.durability_of(folder) == "durable"
    synced = [os.path.basename(p) for p in fsynced]
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "ckpt", DURABILITY_RECORD} <= set(synced)
    assert synced[-1] == DURABILITY_RECORD  # "durable" is recorded once everything else is on disk


def test_durable_save_state_is_durable_when_it_returns(tmp_path, held_worker):
    accelerator = fresh_accelerator(project_config=ProjectConfiguration(durable_save=True))
    prepared(accelerator)
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    assert durability.durability_of(folder) == "durable"  # although the worker is held


def test_default_save_model_is_complete_on_return_and_synced_later(tmp_path, fsynced):
    accelerator = fresh_accelerator()
    model, _ = prepared(accelerator)
    accelerator.save_model(model, str(tmp_path / "out"), max_shard_size="5KB")
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    target = prepared(fresh_accelerator(), seed=1)[0]
    load_checkpoint_in_model(target, str(tmp_path / "out"), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(target).values(), weights(model).values()))
    accelerator.wait_for_checkpoint()
    assert set(names) | {"out"} <= {os.path.basename(p) for p in fsynced}


def test_load_state_skips_a_checkpoint_not_made_durable_before_a_restart(tmp_path, held_worker, caplog):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = fresh_accelerator(project_config=config)
    model, optimizer = prepared(accelerator)
    accelerator.save_state(durable=True)  # checkpoint_0
    saved = weights(model)
    step(model, optimizer)
    newest = accelerator.save_state()  # checkpoint_1: published, its fsync waits behind the held worker
    with open(os.path.join(newest, DURABILITY_RECORD), "w") as f:  # as if the machine had restarted since
        f.write("unsynced another-host another-boot\n")
    accelerator.load_state()
    assert all(torch.equal(a, b) for a, b in zip(weights(model).values(), saved.values()))
    assert accelerator.project_configuration.iteration == 1
    assert "saved without fsync before this machine restarted" in caplog.text


def test_load_state_syncs_a_checkpoint_from_this_boot_and_leaves_its_record_to_the_writer(
    tmp_path, held_worker, fsynced
):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = fresh_accelerator(project_config=config)
    model, optimizer = prepared(accelerator)
    accelerator.save_state(durable=True)
    step(model, optimizer)
    newest = accelerator.save_state()
    saved = weights(model)
    step(model, optimizer)
    record = open(os.path.join(newest, DURABILITY_RECORD)).read()
    fsynced.clear()
    assert accelerator.load_state() == newest  # a process kill, not a restart: the page cache holds it
    assert os.path.join(newest, "model.safetensors") in fsynced  # made durable by the load...
    assert open(os.path.join(newest, DURABILITY_RECORD)).read() == record  # ...which changes nothing on disk
    assert all(torch.equal(a, b) for a, b in zip(weights(model).values(), saved.values()))


def test_rotation_keeps_the_newest_durable_checkpoint_until_the_new_one_is_durable(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    accelerator = fresh_accelerator(project_config=config)
    prepared(accelerator)
    accelerator.save_state(durable=True)
    gate = threading.Event()
    background.saves.submit(gate.wait, "hold")
    accelerator.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]
    gate.set()
    accelerator.wait_for_checkpoint()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1"]


def test_an_asynchronous_save_writes_the_state_as_it_was_at_the_call(tmp_path):
    accelerator = fresh_accelerator(project_config=ProjectConfiguration(async_save=True))
    model, optimizer = prepared(accelerator)
    step(model, optimizer)
    saved, saved_optimizer = weights(model), optimizer.state_dict()["state"][0]["exp_avg"].clone()
    gate = threading.Event()
    background.saves.submit(gate.wait, "hold")  # the write cannot start before training goes on
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    assert not os.path.exists(folder)  # not published yet
    for _ in range(3):
        step(model, optimizer)
    gate.set()
    accelerator.wait_for_checkpoint()
    assert durability.durability_of(folder) == "durable"
    accelerator2 = fresh_accelerator()
    model2, optimizer2 = prepared(accelerator2, seed=5)
    accelerator2.load_state(folder)
    assert all(torch.equal(a, b) for a, b in zip(weights(model2).values(), saved.values()))
    assert torch.equal(optimizer2.state_dict()["state"][0]["exp_avg"], saved_optimizer)


def test_asynchronous_snapshots_reuse_their_memory_and_report_it(tmp_path):
    accelerator = fresh_accelerator()
    model, _ = prepared(accelerator)
    accelerator.save_model(model, str(tmp_path / "a"), async_save=True)
    first = snapshot.buffers.nbytes
    pointers = {b.data_ptr() for bs in snapshot.buffers._buffers.values() for b in bs}
    accelerator.save_model(model, str(tmp_path / "b"), async_save=True)  # joins the first, then copies again
    assert snapshot.buffers.nbytes == first == sum(p.numel() * 4 for p in model.parameters())
    assert {b.data_ptr() for bs in snapshot.buffers._buffers.values() for b in bs} == pointers
    accelerator.end_training()  # joins, and frees the snapshot
    assert snapshot.buffers.nbytes == 0 and os.path.exists(tmp_path / "b" / "model.safetensors")


def test_a_failed_asynchronous_save_raises_at_the_next_join_and_publishes_nothing(tmp_path, monkeypatch):
    from accel.checkpoint import training_state

    accelerator = fresh_accelerator()
    prepared(accelerator)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training_state, "write_files", full_disk)
    folder = accelerator.save_state(str(tmp_path / "ckpt"), async_save=True)
    with pytest.raises(RuntimeError, match="No space left on device"):
        accelerator.wait_for_checkpoint()
    assert not os.path.exists(folder)
    accelerator.wait_for_checkpoint()  # raised once


def test_the_next_save_raises_a_failure_of_the_previous_asynchronous_one(tmp_path, monkeypatch):
    from accel.checkpoint import training_state

    accelerator = fresh_accelerator()
    prepared(accelerator)
    monkeypatch.setattr(training_state, "write_files", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error")))
    accelerator.save_state(str(tmp_path / "a"), async_save=True)
    background.saves.submit(lambda: None, "after the failing save").result()  # it ran (FIFO), nobody joined yet
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="I/O error"):
        accelerator.save_state(str(tmp_path / "b"))


def test_save_mode_resolves_arguments_over_the_project_configuration():
    config = ProjectConfiguration(async_save=True)
    assert SaveMode.resolve(config, None, None) == SaveMode(asynchronous=True, durable=False)
    assert SaveMode.resolve(config, False, True) == SaveMode(asynchronous=False, durable=True)
    assert SaveMode.resolve(ProjectConfiguration(), None, None) == SaveMode()


def test_a_save_model_interrupted_while_publishing_is_read_whole_and_completed_by_the_next_save(tmp_path, monkeypatch):
    folder = str(tmp_path / "out")
    old = {f"{i}.weight": torch.full((64, 64), 1.0) for i in range(4)}
    new = {f"{i}.weight": torch.full((64, 64), 2.0) for i in range(4)}
    model_io.save_state_dict(old, folder, max_shard_size="40KB")
    real_exchange, calls = publish_journal.exchange, []

    def killed_after_the_first_swap(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the first shard is the new one, the second still the old one
        return real_exchange(a, b)

    monkeypatch.setattr(publish_journal, "exchange", killed_after_the_first_swap)
    with pytest.raises(KeyboardInterrupt):
        model_io.save_state_dict(new, folder, max_shard_size="40KB")
    monkeypatch.undo()
    assert os.path.exists(os.path.join(folder, PUBLISH_JOURNAL))
    target = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    load_checkpoint_in_model(target, folder, strict=True)
    assert all(torch.all(p == 2.0) for p in target.parameters())
    assert os.path.exists(os.path.join(folder, PUBLISH_JOURNAL))  # a load changes nothing (issue 19)
    model_io.save_state_dict(new, folder, max_shard_size="40KB")
    assert not os.path.exists(os.path.join(folder, PUBLISH_JOURNAL))
    assert not [name for name in os.listdir(folder) if ".tmp-" in name]


KILLED_SAVER = textwrap.dedent(
    """
    import os, sys, torch
    from accel.accelerator import Accelerator
    folder = sys.argv[1]
    accelerator = Accelerator()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])  # 4 MiB, 2 shards
    iteration = 0
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(iteration)
        accelerator.save_model(model, folder, max_shard_size="2MB")
        iteration += 1
        if iteration == 1:
            print("ready", flush=True)
    """
)


def test_save_model_killed_at_any_moment_leaves_one_whole_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    generator = random.Random(1)
    for run in range(5):
        folder = tmp_path / f"run{run}"
        child = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(generator.uniform(0.0, 0.5))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        target = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])
        load_checkpoint_in_model(target, str(folder), strict=True)
        values = {p[0, 0].item() for p in target.parameters()}
        assert len(values) == 1 and all(torch.all(p == p[0, 0]) for p in target.parameters())  # never a mix


def test_a_replaced_checkpoint_is_removed_before_the_save_returns(tmp_path, held_worker):
    accelerator = fresh_accelerator()
    prepared(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"), durable=True)
    accelerator.save_state(str(tmp_path / "ckpt"))  # swaps the folder in; the old one goes before the return
    assert os.listdir(tmp_path) == ["ckpt"]


def test_what_a_killed_process_left_to_delete_is_swept_by_the_next_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".ckpt.discarded-{dead.stdout.strip()}-abcd1234"
    (leftover / "sub").mkdir(parents=True)
    accelerator = fresh_accelerator()
    prepared(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert not leftover.exists()


def _asynchronous_save_on_ranks(folder):
    accelerator = Accelerator(project_config=ProjectConfiguration(async_save=True))
    model, optimizer = prepared(accelerator)
    step(model, optimizer)
    saved = weights(model)
    accelerator.save_state(folder)
    step(model, optimizer)  # training goes on while the main process writes
    accelerator.save_state(folder + "-next")  # joins the first
    accelerator.wait_for_checkpoint()
    accelerator.load_state(folder)
    same = all(torch.equal(a, b) for a, b in zip(weights(model).values(), saved.values()))
    return same, durability.durability_of(folder), sorted(n for n in os.listdir(folder) if n.startswith("random"))


def test_an_asynchronous_save_on_two_processes_publishes_every_process_files(tmp_path):
    from spawn_pool import run_on_ranks

    expected = (True, "durable", ["random_states_0.pkl", "random_states_1.pkl"])
    assert run_on_ranks(_asynchronous_save_on_ranks, 2, str(tmp_path / "ckpt"), timeout=180) == [expected, expected]
