"""save_state / load_state under adversity (issue 19, defects 2-6): links planted at staging names, two jobs
saving into one folder, asynchronous saves joined on every process, a failed asynchronous save at exit, and a
checkpoint loaded by another number of processes than saved it."""

import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from spawn_pool import run_on_ranks

from accel.accelerator import Accelerator
from accel.accelerator_config import GradientAccumulationPlugin
from accel.checkpoint import background, publish, training_state
from accel.checkpoint.names import PUBLISH_JOURNAL as PUBLISH_JOURNAL_NAME
from accel.checkpoint.target_lock import TargetLock, WriterBusyError
from accel.state import AcceleratorState, GradientState


def fresh_accelerator(**kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def prepared_linear(accelerator, value=0.0):
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def set_weights(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def weight_value(model):
    values = {p.detach().flatten()[0].item() for p in model.parameters()}
    assert len(values) == 1, values
    return values.pop()


@pytest.fixture(autouse=True)
def _idle_worker():
    yield
    try:
        background.saves.join()
    except RuntimeError:  # a failure a test provoked and checked
        pass


def _leftovers(folder):
    """What a save may never leave next to or in a checkpoint: staging folders, temporaries, lock files."""
    names = os.listdir(folder)
    return [n for n in names if re.search(r"\.partial|\.tmp-|\.lock$|\.discarded-", n)]


# --- defect 2: staging never follows a planted link ------------------------------------------------------------


def test_a_link_planted_at_an_old_staging_name_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.safetensors").write_bytes(b"the victim's file")
    for name in (".ckpt.partial", ".ckpt.partial-node0"):
        os.symlink(victim, tmp_path / name)
    accelerator = fresh_accelerator()
    prepared_linear(accelerator, 1.0)
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert (victim / "model.safetensors").read_bytes() == b"the victim's file"
    assert os.listdir(victim) == ["model.safetensors"]
    assert os.path.isdir(tmp_path / "ckpt") and not os.path.islink(tmp_path / "ckpt")
    assert load_file(str(tmp_path / "ckpt" / "model.safetensors"))["weight"][0, 0].item() == 1.0
    assert os.path.islink(tmp_path / ".ckpt.partial")  # someone else's entry: left alone


def test_staging_names_are_new_and_created_exclusively(tmp_path, monkeypatch):
    """Even a name guessed right (here: the randomness pinned) is refused rather than written through."""
    monkeypatch.setattr(publish.secrets, "token_hex", lambda n: "ab" * n)
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, tmp_path / f".ckpt.partial-{os.getpid()}-{'ab' * 8}")
    accelerator = fresh_accelerator()
    prepared_linear(accelerator)
    with pytest.raises(FileExistsError):
        accelerator.save_state(str(tmp_path / "ckpt"))
    assert os.listdir(victim) == [] and not os.path.exists(tmp_path / "ckpt")
    monkeypatch.undo()
    first = publish.create_staging(str(tmp_path / "other"))
    second = publish.create_staging(str(tmp_path / "other"))
    assert first != second and os.path.isdir(first) and os.path.isdir(second)


# --- defect 3: one writer at a time -----------------------------------------------------------------------------


def test_a_second_writer_waits_for_the_first_then_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "0.3")
    target = str(tmp_path / "ckpt")
    accelerator = fresh_accelerator()
    prepared_linear(accelerator, 2.0)
    with TargetLock.acquire(target, timeout_s=1):  # another writer, as far as the save can tell
        started = time.monotonic()
        with pytest.raises(WriterBusyError, match=rf"pid {os.getpid()} on"):
            accelerator.save_state(target)
        assert time.monotonic() - started >= 0.3
    assert os.listdir(tmp_path) == []  # nothing staged, nothing published, no lock file
    accelerator.save_state(target)
    assert _leftovers(tmp_path) == [] and os.path.isdir(target)


def test_save_model_waits_for_another_writer_of_its_folder(tmp_path, monkeypatch):
    """save_model's journal publishes one writer's files at a time: a second writer waits for the first."""
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "5")
    folder = str(tmp_path / "model")
    accelerator = fresh_accelerator()
    model, _ = prepared_linear(accelerator, 5.0)
    held = TargetLock.acquire(folder, timeout_s=1)
    releaser = threading.Timer(0.3, held.release)
    started = time.monotonic()
    releaser.start()
    accelerator.save_model(model, folder)
    assert time.monotonic() - started >= 0.3  # it waited for the other writer
    releaser.join()
    assert load_file(os.path.join(folder, "model.safetensors"))["weight"][0, 0].item() == 5.0
    assert _leftovers(tmp_path) == [] and _leftovers(folder) == []


def test_an_asynchronous_save_waits_for_another_writer_of_its_folder_in_the_background(tmp_path, monkeypatch):
    """The folder's lock is the worker's to take: the call returns while another writer holds it, and the
    checkpoint is published once that writer is done."""
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "5")
    folder = str(tmp_path / "ckpt")
    accelerator = fresh_accelerator()
    prepared_linear(accelerator, 5.0)
    held = TargetLock.acquire(folder, timeout_s=1)
    try:
        accelerator.save_state(folder, async_save=True)  # waiting for the lock here would end in WriterBusyError
        assert not os.path.exists(folder)
    finally:
        held.release()
    accelerator.wait_for_checkpoint()
    assert load_file(os.path.join(folder, "model.safetensors"))["weight"][0, 0].item() == 5.0
    assert _leftovers(tmp_path) == [] and _leftovers(folder) == []


JOB_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from accel.accelerator import Accelerator
    folder, job, saves, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    accelerator = Accelerator()
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=job)  # the optimizer's file names its job too
    model, optimizer = accelerator.prepare(model, optimizer)
    while not __import__("os").path.exists(start):
        pass
    for i in range(saves):
        with torch.no_grad():
            model.weight.fill_(job * 1000 + i)
        accelerator.save_state(folder)
    """
)


def _published_pair(folder):
    """(the model's job, the optimizer's job) of the checkpoint published at `folder` now, both read from that
    one folder (through a descriptor of it), or None when it was replaced while being read."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        base = f"/proc/self/fd/{fd}"
        weight = load_file(f"{base}/model.safetensors")["weight"][0, 0].item()
        lr = torch.load(f"{base}/optimizer.bin", weights_only=True)["param_groups"][0]["lr"]
    except (FileNotFoundError, OSError, RuntimeError):  # this folder was discarded while we read it
        return None
    finally:
        os.close(fd)
    return int(weight) // 1000, int(lr)


def test_two_jobs_saving_into_one_folder_publish_only_whole_checkpoints(tmp_path):
    script, folder, start = tmp_path / "job.py", str(tmp_path / "ckpt"), str(tmp_path / "go")
    script.write_text(JOB_SCRIPT)
    jobs = [
        subprocess.Popen(
            [sys.executable, str(script), folder, str(job), "15", start], stderr=subprocess.PIPE, text=True
        )
        for job in (1, 2)
    ]
    time.sleep(1.0)
    open(start, "w").close()
    seen = set()
    try:
        while any(job.poll() is None for job in jobs):
            pair = _published_pair(folder)
            if pair is not None:
                seen.add(pair)
        errors = [job.communicate(timeout=60)[1] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0], errors
    seen.add(_published_pair(folder))
    assert seen <= {(1, 1), (2, 2)}, f"a checkpoint mixed two jobs' files: {seen}"
    assert _leftovers(tmp_path) == [] and _leftovers(folder) == []


# --- defect 4: every join point waits for every process's asynchronous save ----------------------------------


def _async_save_then_load(folder):
    accelerator = fresh_accelerator()
    model, _ = prepared_linear(accelerator, 1.0)
    accelerator.save_state(folder)
    set_weights(model, 2.0)
    real = training_state.write_files
    if accelerator.process_index == 0:  # the main process's background write is slow
        training_state.write_files = lambda *args, **kwargs: (time.sleep(1.0), real(*args, **kwargs))
    try:
        accelerator.save_state(folder, async_save=True)
        set_weights(model, 3.0)
        accelerator.load_state(folder)
        loaded = weight_value(model)
        set_weights(model, 4.0)
        accelerator.save_state(folder, async_save=True)
        accelerator.wait_for_checkpoint()
    finally:
        training_state.write_files = real
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    accelerator.end_training()  # a join point on every process too
    accelerator.end_training()  # a second one (its group destroyed) does not wait for anyone
    return loaded, next(t for name, t in tensors.items() if name.endswith("weight"))[0, 0].item()


def test_load_state_and_wait_for_checkpoint_wait_for_the_asynchronous_save_of_every_process(tmp_path):
    results = run_on_ranks(_async_save_then_load, 2, str(tmp_path / "ckpt"), timeout=120)
    assert results == [(2.0, 4.0), (2.0, 4.0)]


# --- defect 5: a failed asynchronous save is never lost --------------------------------------------------------


def _fail_background_writes(monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training_state, "write_files", no_space)


def test_a_failed_asynchronous_save_raises_at_the_next_join_point_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    accelerator = fresh_accelerator()
    prepared_linear(accelerator)
    _fail_background_writes(monkeypatch)
    accelerator.save_state(str(tmp_path / "ckpt"), async_save=True)
    with pytest.raises(RuntimeError, match="No space left on device"):
        accelerator.wait_for_checkpoint()
    assert os.listdir(tmp_path) == []


def _raised(call):
    """(the exception's type name, its message) that `call()` raised, else None."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what the test compares
        return type(error).__name__, str(error)
    return None


def _fails_at_the_call_on_rank_one(folder, where):
    """Rank 1's asynchronous save fails at its call: in a pre-hook only rank 1 has ("hook": every process agrees
    on the staging folder at the call) or while it copies its state ("copy": nothing is agreed at the call).
    Returns what each call and the next join raised, the checkpoint number the next save takes, what was left
    beside the folder, the weights loaded after it, and those of a later asynchronous save (the workers'
    exchanges still pair up)."""
    accelerator = fresh_accelerator()
    model, _ = prepared_linear(accelerator, 1.0)
    accelerator.save_state(folder)  # the previous checkpoint
    set_weights(model, 2.0)
    real = training_state.rng_states

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    hook = None
    if accelerator.process_index == 1 and where == "hook":
        hook = accelerator.register_save_state_pre_hook(no_space)
    if accelerator.process_index == 1 and where == "copy":
        training_state.rng_states = no_space
    try:
        at_call = _raised(lambda: accelerator.save_state(folder, async_save=True))
    finally:
        training_state.rng_states = real
        if hook is not None:
            hook.remove()
    iteration = accelerator.project_configuration.iteration  # the same on every process (automatic naming)
    at_join = _raised(accelerator.wait_for_checkpoint)
    leftovers = _leftovers(os.path.dirname(folder))
    accelerator.load_state(folder)
    loaded = weight_value(model)
    set_weights(model, 3.0)
    accelerator.save_state(folder, async_save=True)
    accelerator.wait_for_checkpoint()
    set_weights(model, 0.0)
    accelerator.load_state(folder)
    return at_call, at_join, iteration, leftovers, loaded, weight_value(model)


@pytest.mark.parametrize("where", ["hook", "copy"])
def test_a_failure_at_one_process_call_fails_the_asynchronous_save_everywhere(tmp_path, where):
    """The failing call raises; the others return, and every process raises at the next join point; nothing is
    published and the staging folder is removed."""
    folder = str(tmp_path / "ckpt")
    results = run_on_ranks(_fails_at_the_call_on_rank_one, 2, folder, where, timeout=120)
    (call_0, join_0, *rest_0), (call_1, join_1, *rest_1) = results
    assert call_0 is None and call_1 == ("OSError", "[Errno 28] No space left on device")
    assert join_0[0] == "RuntimeError" and "failed on process 1" in join_0[1], join_0
    assert join_1[0] == "RuntimeError" and "another process" in join_1[1], join_1
    assert rest_0 == rest_1 == [2, [], 1.0, 3.0]


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from accel.accelerator import Accelerator
    from accel.checkpoint import training_state
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")
    training_state.write_files = no_space
    accelerator = Accelerator()
    accelerator.prepare(torch.nn.Linear(4, 4))
    accelerator.save_state(sys.argv[1], async_save=True)
    print("script finished", flush=True)
    """
)


def test_a_failed_asynchronous_save_makes_the_process_exit_non_zero(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(EXIT_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, str(script), str(out / "ckpt")], capture_output=True, text=True, timeout=120)
    assert "script finished" in done.stdout
    assert done.returncode == 1, done.stderr
    assert "No space left on device" in done.stderr and "exiting with status 1" in done.stderr
    assert os.listdir(out) == []  # the partial folder is gone


# --- defect 6: the step is the checkpoint's on every process; another world size is handled ---------------------


def _train_steps(accelerator, model, optimizer, steps):
    for _ in range(steps):
        with accelerator.accumulate(model):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def _save_after_steps(folder, steps):
    accelerator = fresh_accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    model, optimizer = prepared_linear(accelerator)
    _train_steps(accelerator, model, optimizer, steps)
    accelerator.save_state(folder)
    return accelerator.step


def _load_and_step(folder):
    accelerator = fresh_accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    model, optimizer = prepared_linear(accelerator)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("accel.checkpoint.training_state").addHandler(handler)
    try:
        accelerator.load_state(folder)
    finally:
        logging.getLogger("accel.checkpoint.training_state").removeHandler(handler)
    step = accelerator.step
    draw = torch.rand(3).tolist()
    with accelerator.accumulate(model):
        sync = accelerator.sync_gradients
    return step, sync, draw, [r for r in records if "saved by" in r]


def test_a_checkpoint_saved_by_one_process_loads_on_two_with_one_step_and_distinct_random_states(tmp_path):
    folder = str(tmp_path / "ckpt")
    assert _save_after_steps(folder, 3) == 3
    first = run_on_ranks(_load_and_step, 2, folder, timeout=120)
    (step_0, sync_0, draw_0, warned_0), (step_1, sync_1, draw_1, warned_1) = first
    assert step_0 == step_1 == 3 and sync_0 == sync_1 is True
    assert draw_0 != draw_1  # process 1 derived its own states instead of sharing process 0's
    assert len(warned_0) == 1 and "saved by 1 processes and is loaded by 2" in warned_0[0] and warned_1 == []
    again = run_on_ranks(_load_and_step, 2, folder, timeout=120)
    assert [r[2] for r in again] == [draw_0, draw_1]  # derived the same way on every load


def test_a_checkpoint_saved_by_two_processes_loads_in_one_with_its_step(tmp_path):
    folder = str(tmp_path / "ckpt")
    assert run_on_ranks(_save_after_steps, 2, folder, 5, timeout=120) == [5, 5]
    step, sync, _, warned = _load_and_step(folder)
    assert step == 5 and sync is True
    assert len(warned) == 1 and "saved by 2 processes and is loaded by 1" in warned[0]


def _checkpoint_folder(root, name: str, weights: str, shard: str, extra: dict | None = None) -> str:
    """A folder holding a weight file and an FSDP-style sharded-state folder (plus `extra` files)."""
    folder = root / name
    (folder / "pytorch_model_fsdp_0").mkdir(parents=True)
    (folder / "pytorch_model_fsdp_0" / "__0_0.distcp").write_text(shard)
    (folder / "model.safetensors").write_text(weights)
    for file, text in (extra or {}).items():
        (folder / file).write_text(text)
    return str(folder)


@pytest.mark.parametrize("swaps", [True, False], ids=["renameat2", "without-renameat2"])
def test_a_folder_with_other_files_gets_its_sharded_state_folders_replaced_too(tmp_path, monkeypatch, swaps):
    """A checkpoint folder that also holds the user's files is updated entry by entry (through a journal); an entry
    that is a folder (FSDP's sharded state) replaces the old folder of that name, which a plain rename cannot do
    when it is not empty."""
    if not swaps:
        monkeypatch.setattr(publish, "exchange", lambda a, b: False)
        monkeypatch.setattr("accel.checkpoint.publish_journal.exchange", lambda a, b: False)
    final = _checkpoint_folder(tmp_path, "out", "old weights", "old shard", {"logs.txt": "the user's"})
    staged = _checkpoint_folder(tmp_path, ".out.partial-1-0123456789abcdef", "new weights", "new shard")
    publish.publish(staged, final)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing left beside it: the staging folder, the old entries
    assert sorted(os.listdir(final)) == ["logs.txt", "model.safetensors", "pytorch_model_fsdp_0"]
    assert (tmp_path / "out" / "logs.txt").read_text() == "the user's"
    assert (tmp_path / "out" / "model.safetensors").read_text() == "new weights"
    assert os.listdir(tmp_path / "out" / "pytorch_model_fsdp_0") == ["__0_0.distcp"]
    assert (tmp_path / "out" / "pytorch_model_fsdp_0" / "__0_0.distcp").read_text() == "new shard"


# --- a publish into a folder with other files, killed midway (issue 23: one publish protocol) ----------------------


class _Counter:
    """An object registered for checkpointing: its value tells which save its custom checkpoint came from."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _save(folder: str, value: float) -> None:
    accelerator = fresh_accelerator()
    prepared_linear(accelerator, value)
    accelerator.register_for_checkpointing(_Counter(int(value)))
    accelerator.save_state(folder)
    accelerator.wait_for_checkpoint()  # the durability record is rewritten in the background: done before the checks


def _load(folder: str) -> tuple[float, int]:
    """(the weights' value, the registered object's value) of the checkpoint `folder` loads as."""
    accelerator = fresh_accelerator()
    model, _ = prepared_linear(accelerator)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.load_state(folder)
    return model.weight[0, 0].item(), counter.value


def _killed_at_swap(monkeypatch, call: int):
    """publish_journal's swaps raise at the `call`-th one (a kill while the entries move into place)."""
    from accel.checkpoint import publish_journal

    real_exchange, calls = publish_journal.exchange, []

    def exchange(a, b):
        calls.append(b)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real_exchange(a, b)

    monkeypatch.setattr(publish_journal, "exchange", exchange)


def _listing(folder: str) -> dict[str, tuple[int, int]]:
    return {
        name: (os.lstat(os.path.join(folder, name)).st_ino, os.lstat(os.path.join(folder, name)).st_size)
        for name in os.listdir(folder)
    }


def test_a_save_into_a_folder_with_other_files_killed_while_publishing_loads_whole_and_is_completed(
    tmp_path, monkeypatch
):
    """Killed after the durability record and the custom checkpoint moved in, before the weights did: the folder
    then holds the new custom checkpoint beside the old weights. A load reads the new checkpoint whole (through the
    journal) and changes nothing; the next save completes the interrupted one, then publishes its own."""
    views = tmp_path / "tmp"
    views.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(views))
    folder = str(tmp_path / "out")
    os.makedirs(folder)
    (tmp_path / "out" / "logs.txt").write_text("the user's")
    _save(folder, 1.0)
    with monkeypatch.context() as patched:
        _killed_at_swap(patched, 3)  # swaps: the record, custom_checkpoint_0.pkl, then model.safetensors
        with pytest.raises(KeyboardInterrupt):
            _save(folder, 2.0)
    assert os.path.exists(os.path.join(folder, ".accel-publish.json"))
    assert load_file(os.path.join(folder, "model.safetensors"))["weight"][0, 0].item() == 1.0  # the old weights
    before = _listing(folder)
    assert _load(folder) == (2.0, 2)  # never the mix (1.0, 2) the folder holds at the entries' names
    assert _listing(folder) == before  # the load changed nothing
    assert os.listdir(views) == []  # the load's view of the new checkpoint is gone
    _save(folder, 3.0)
    assert sorted(os.listdir(folder)) == [
        ".accel-durability",
        "custom_checkpoint_0.pkl",
        "logs.txt",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    ]
    assert (tmp_path / "out" / "logs.txt").read_text() == "the user's"
    assert _load(folder) == (3.0, 3)


def test_a_save_into_a_folder_with_other_files_removes_the_previous_checkpoints_extra_entries(tmp_path):
    """An earlier save with more processes or more registered objects left entries this one does not write: they
    go with it (a stale custom checkpoint would make the load count two registered objects), the user's stay."""
    folder = str(tmp_path / "out")
    os.makedirs(folder)
    (tmp_path / "out" / "logs.txt").write_text("the user's")
    _save(folder, 1.0)
    for stale in ("custom_checkpoint_1.pkl", "random_states_3.pkl"):
        (tmp_path / "out" / stale).write_bytes(b"an earlier save's")
    _save(folder, 2.0)
    assert "custom_checkpoint_1.pkl" not in os.listdir(folder) and "random_states_3.pkl" not in os.listdir(folder)
    assert (tmp_path / "out" / "logs.txt").read_text() == "the user's"
    assert _load(folder) == (2.0, 2)


@pytest.mark.parametrize("swaps", [True, False], ids=["renameat2", "without-renameat2"])
def test_a_publish_of_folders_killed_midway_is_read_through_a_view_and_replayed(tmp_path, monkeypatch, swaps):
    """Sharded-state folders too: after a kill between two entries, a load reads every new entry (files and
    folders) through a private view of links, and the folder's other entries; the writer's next save replays."""
    if not swaps:
        monkeypatch.setattr(publish, "exchange", lambda a, b: False)
        monkeypatch.setattr("accel.checkpoint.publish_journal.exchange", lambda a, b: False)
    final = _checkpoint_folder(tmp_path, "out", "old weights", "old shard", {"logs.txt": "the user's"})
    staged = _checkpoint_folder(tmp_path, ".out.partial-1-0123456789abcdef", "new weights", "new shard")
    from accel.checkpoint import publish_journal

    real_rename, real_replace, calls = os.rename, os.replace, []

    def killed_at_the_second_move_into_place(source, target):
        """Without renameat2 a file is renamed over its old one (os.replace), a folder renamed in after its old one
        was renamed aside (os.rename): counts the moves of new entries into place."""
        name = os.path.basename(os.fspath(source))
        if ".tmp-" in name and PUBLISH_JOURNAL_NAME not in name and os.path.dirname(os.fspath(source)) == final:
            calls.append(target)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return (real_replace if os.path.isfile(source) else real_rename)(source, target)

    with monkeypatch.context() as patched:
        if swaps:
            _killed_at_swap(patched, 2)
        else:
            patched.setattr(os, "rename", killed_at_the_second_move_into_place)
            patched.setattr(os, "replace", killed_at_the_second_move_into_place)
        with pytest.raises(KeyboardInterrupt):
            publish.publish(staged, final)
    assert os.path.exists(os.path.join(final, PUBLISH_JOURNAL_NAME))
    assert (tmp_path / "out" / "model.safetensors").read_text() == "new weights"  # moved in
    if swaps:
        assert (tmp_path / "out" / "pytorch_model_fsdp_0" / "__0_0.distcp").read_text() == "old shard"
    else:  # renamed aside, the new one not yet in
        assert not os.path.exists(os.path.join(final, "pytorch_model_fsdp_0"))
    before = _listing(final)
    with publish.readable_folder(final) as view:
        assert view != final
        with open(os.path.join(view, "model.safetensors")) as f:
            assert f.read() == "new weights"
        assert os.listdir(os.path.join(view, "pytorch_model_fsdp_0")) == ["__0_0.distcp"]
        with open(os.path.join(view, "pytorch_model_fsdp_0", "__0_0.distcp")) as f:
            assert f.read() == "new shard"
        with open(os.path.join(view, "logs.txt")) as f:
            assert f.read() == "the user's"
        assert sorted(os.listdir(view)) == ["logs.txt", "model.safetensors", "pytorch_model_fsdp_0"]
    assert not os.path.exists(view) and _listing(final) == before
    monkeypatch.setattr(publish_journal, "process_alive", lambda pid: False)  # the killed writer is gone
    publish.prepare_staging(final, staged=True)  # what the writer's next save does first
    assert (tmp_path / "out" / "model.safetensors").read_text() == "new weights"
    assert (tmp_path / "out" / "pytorch_model_fsdp_0" / "__0_0.distcp").read_text() == "new shard"
    assert (tmp_path / "out" / "logs.txt").read_text() == "the user's"
    assert not [name for name in os.listdir(final) if ".tmp-" in name or name == ".accel-publish.json"]


def test_a_save_into_a_folder_with_other_files_leaves_a_users_link_alone(tmp_path):
    """A symbolic link of the user's with a checkpoint entry's name (DeepSpeed's `latest`) is neither removed nor
    named in the journal (which would then be refused)."""
    folder = str(tmp_path / "out")
    os.makedirs(folder)
    (tmp_path / "out" / "logs.txt").write_text("the user's")
    (tmp_path / "elsewhere").write_text("linked")
    os.symlink(str(tmp_path / "elsewhere"), os.path.join(folder, "latest"))
    _save(folder, 1.0)
    _save(folder, 2.0)
    assert os.path.islink(os.path.join(folder, "latest")) and (tmp_path / "elsewhere").read_text() == "linked"
    assert _load(folder) == (2.0, 2)
