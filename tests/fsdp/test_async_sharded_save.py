"""save_state(async_save=True) under FSDP2 with sharded state (issue 21, point 5): the DCP folders are copied at
the call and written in the background through a gloo group of their own; the checkpoint is published only once
every process's part is written, and resumes as a synchronous save's does. With FULL_STATE_DICT the full state is
gathered at the call and the main process's worker writes its files. A failed write, asynchronous or not, raises on
every process and leaves the previous checkpoint."""

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist
from spawn_pool import RankFailed, run_on_ranks

from accel.accelerator import Accelerator
from accel.backends.fsdp import FullyShardedDataParallelPlugin
from accel.checkpoint import background, sharded, training_state
from accel.state import AcceleratorState, GradientState


def fresh_accelerator(state_dict_type="SHARDED_STATE_DICT"):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type))


def prepared(accelerator, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return accelerator.prepare(model, optimizer)


def train(accelerator, model, optimizer, steps, seed):
    generator = torch.Generator().manual_seed(100 * seed + accelerator.process_index)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(4, 8, generator=generator)
        loss = model(inputs).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_weights(accelerator, model):
    return {name: t.clone() for name, t in accelerator.get_state_dict(model).items()}


@contextlib.contextmanager
def writes_held_back(ranks):
    """The background writes of the shards of `ranks` wait until the block ends (or 30 s)."""
    real = sharded.StagedShards.write
    released = threading.Event()

    def held_back(self, staging):
        if dist.get_rank() in ranks:
            released.wait(30)
        real(self, staging)

    sharded.StagedShards.write = held_back
    try:
        yield
        released.set()
    finally:
        released.set()
        sharded.StagedShards.write = real


def _resume(folder, async_save):
    """(the losses after the save, straight on and after resuming; the weights right at the save, and loaded)."""
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, 3, seed=1)
    at_save = full_weights(accelerator, model)
    with writes_held_back({0, 1}):
        accelerator.save_state(folder, async_save=async_save)
        straight = train(accelerator, model, optimizer, 3, seed=2)  # changes the live state before it is written
    accelerator.wait_for_checkpoint()
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator, seed=7)
    accelerator.load_state(folder)
    loaded = full_weights(accelerator, model)
    resumed = train(accelerator, model, optimizer, 3, seed=2)
    return straight, resumed, at_save, loaded, sorted(os.listdir(folder))


def test_an_asynchronous_sharded_save_resumes_as_a_synchronous_one_and_holds_the_state_of_its_call(tmp_path):
    synchronous = run_on_ranks(_resume, 2, str(tmp_path / "sync"), False, timeout=120)
    asynchronous = run_on_ranks(_resume, 2, str(tmp_path / "async"), True, timeout=120)
    for (straight, resumed, at_save, loaded, listing), reference in zip(asynchronous, synchronous):
        assert straight == resumed == reference[1]  # bit-identical to the synchronous save's resume
        assert {"pytorch_model_fsdp_0", "optimizer_0", "random_states_1.pkl"} <= set(listing)
        assert sorted(os.listdir(tmp_path / "async" / "pytorch_model_fsdp_0")) == sorted(
            os.listdir(tmp_path / "sync" / "pytorch_model_fsdp_0")
        )
    at_save, loaded = asynchronous[0][2], asynchronous[0][3]  # the main process holds the full weights
    for name, tensor in at_save.items():  # the steps taken while it was written did not leak into it
        assert torch.equal(loaded[name], tensor), name
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no staging folder left


def _resume_from_second_save(folder, async_save):
    """As _resume, from the second of two saves with training between them: the second asynchronous save copies
    into the copy the first made (accel.checkpoint.shard_stager), which must hold the state of its own call."""
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, 3, seed=1)
    accelerator.save_state(os.path.join(folder, "first"), async_save=async_save)
    train(accelerator, model, optimizer, 2, seed=3)
    at_save = full_weights(accelerator, model)
    with writes_held_back({0, 1}):
        accelerator.save_state(os.path.join(folder, "second"), async_save=async_save)
        straight = train(accelerator, model, optimizer, 3, seed=2)
    accelerator.wait_for_checkpoint()
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator, seed=7)
    accelerator.load_state(os.path.join(folder, "second"))
    loaded = full_weights(accelerator, model)
    return straight, train(accelerator, model, optimizer, 3, seed=2), at_save, loaded


def test_a_second_asynchronous_sharded_save_holds_the_state_of_its_own_call(tmp_path):
    synchronous = run_on_ranks(_resume_from_second_save, 2, str(tmp_path / "sync"), False, timeout=120)
    asynchronous = run_on_ranks(_resume_from_second_save, 2, str(tmp_path / "async"), True, timeout=120)
    for (straight, resumed, _, _), reference in zip(asynchronous, synchronous):
        assert straight == resumed == reference[1]
    at_save, loaded = asynchronous[0][2], asynchronous[0][3]  # the main process holds the full weights
    for name, tensor in at_save.items():  # the steps taken while it was written did not leak into it
        assert torch.equal(loaded[name], tensor), name


def _slow_background_write(folder):
    """The write of rank 1's shards is held back; the checkpoint must not appear until it is done."""
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, 1, seed=1)
    with writes_held_back({1}):
        accelerator.save_state(folder, async_save=True)
        train(accelerator, model, optimizer, 2, seed=2)  # training goes on meanwhile (its own collectives)
        published_early = os.path.exists(folder)
    accelerator.wait_for_checkpoint()
    default, group = sharded._write_group_of
    own_group = default is dist.distributed_c10d._get_default_group() and group is not default
    own_group = own_group and dist.get_backend(group) == "gloo"
    return published_early, os.path.exists(os.path.join(folder, "pytorch_model_fsdp_0", ".metadata")), own_group


def test_the_checkpoint_is_published_only_after_every_process_wrote_its_shards(tmp_path):
    results = run_on_ranks(_slow_background_write, 2, str(tmp_path / "ckpt"), timeout=120)
    assert results == [(False, True, True), (False, True, True)]


def _failing_write(folder, async_save=True):
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    accelerator.save_state(folder)  # the previous checkpoint
    before = full_weights(accelerator, model)
    train(accelerator, model, optimizer, 1, seed=1)
    real = dist.checkpoint.FileSystemWriter.write_data

    def no_space(self, plan, planner):
        if accelerator.process_index == 1:
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    dist.checkpoint.FileSystemWriter.write_data = no_space
    try:
        try:
            accelerator.save_state(folder, async_save=async_save)
            accelerator.wait_for_checkpoint()
            raised = None
        except RuntimeError as error:
            raised = str(error)
    finally:
        dist.checkpoint.FileSystemWriter.write_data = real
    accelerator.load_state(folder)
    loaded = full_weights(accelerator, model)
    unchanged = all(torch.equal(loaded[name], t) for name, t in before.items())
    return raised, unchanged, sorted(os.listdir(os.path.dirname(folder)))


def test_a_failed_background_write_of_one_process_raises_on_every_process_and_publishes_nothing(tmp_path):
    results = run_on_ranks(_failing_write, 2, str(tmp_path / "ckpt"), timeout=120)
    for raised, unchanged, listing in results:
        assert raised is not None and ("No space left on device" in raised or "another process" in raised), raised
        assert listing == ["ckpt"]  # the staging folder is gone
    assert "No space left on device" in results[1][0]
    assert results[0][1]  # the previous checkpoint is the one loaded


def test_a_failed_synchronous_sharded_write_raises_on_every_process_and_leaves_no_staging_folder(tmp_path):
    # DCP raises a BaseException (CheckpointException); the synchronous save's agreement must still see it.
    results = run_on_ranks(_failing_write, 2, str(tmp_path / "ckpt"), False, timeout=120)
    for raised, unchanged, listing in results:
        assert raised is not None and ("No space left on device" in raised or "another process" in raised), raised
        assert listing == ["ckpt"]  # the staging folder is gone
        assert unchanged  # the previous checkpoint is the one loaded
    assert "No space left on device" in results[1][0]


def _killed_mid_write(folder):
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    accelerator.save_state(folder)  # the previous checkpoint
    train(accelerator, model, optimizer, 2, seed=1)
    real = dist.checkpoint.FileSystemWriter.write_data

    def dies_after_writing(self, plan, planner):
        written = real(self, plan, planner)
        if accelerator.process_index == 1:
            written.wait()
            os._exit(9)  # killed with its shard written, before DCP's last collective
        return written

    dist.checkpoint.FileSystemWriter.write_data = dies_after_writing
    accelerator.save_state(folder, async_save=True)
    background.saves.join()  # rank 1 dies in its worker; rank 0 waits in the write's collective meanwhile


def _weights_of(folder):
    accelerator = fresh_accelerator()
    model, _ = prepared(accelerator, seed=7)
    accelerator.load_state(folder)
    return full_weights(accelerator, model)


def _weights_at_start():
    accelerator = fresh_accelerator()
    model, _ = prepared(accelerator)
    return full_weights(accelerator, model)


def test_a_process_killed_mid_asynchronous_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    folder = str(tmp_path / "ckpt")
    try:
        run_on_ranks(_killed_mid_write, 2, folder, timeout=60)
        raise AssertionError("rank 1 was expected to die")
    except RankFailed as failure:  # the pool kills rank 0 too, in the middle of its save
        assert failure.rank == 1
    loaded = run_on_ranks(_weights_of, 2, folder, timeout=120)[0]
    expected = run_on_ranks(_weights_at_start, 2, timeout=60)[0]
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def _full_state_written_in_the_background(folder):
    """(the model's file was in the staging folder when save_state returned, it holds the weights of the call)."""
    accelerator = fresh_accelerator("FULL_STATE_DICT")
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, 2, seed=1)
    at_save = full_weights(accelerator, model)
    real = training_state.write_files
    released = threading.Event()
    training_state.write_files = lambda *args, **kwargs: (released.wait(30), real(*args, **kwargs))
    try:
        accelerator.save_state(folder, async_save=True)
        parent = os.path.dirname(folder)
        staging = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(".ckpt.partial")]
        written_in_call = any(os.path.exists(os.path.join(s, "pytorch_model_fsdp.bin")) for s in staging)
        train(accelerator, model, optimizer, 2, seed=2)  # changes the live state before it is written
        released.set()
        accelerator.wait_for_checkpoint()
    finally:
        released.set()
        training_state.write_files = real
    if accelerator.process_index != 0:
        return written_in_call, None
    saved = torch.load(os.path.join(folder, "pytorch_model_fsdp.bin"), weights_only=True)
    return written_in_call, all(torch.equal(saved[name], t) for name, t in at_save.items())


def test_an_asynchronous_full_state_save_gathers_at_the_call_and_writes_in_the_background(tmp_path):
    results = run_on_ranks(_full_state_written_in_the_background, 2, str(tmp_path / "ckpt"), timeout=120)
    assert results == [(False, True), (False, None)]


SURVIVOR_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    import torch.distributed.checkpoint as dcp
    from accel.accelerator import Accelerator
    from accel.backends.fsdp import FullyShardedDataParallelPlugin
    from accel.checkpoint import training_state
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(sys.argv[1])
    real = dcp.FileSystemWriter.write_data
    def dies(self, plan, planner):
        if accelerator.process_index == 1:
            os._exit(9)  # killed in the middle of the asynchronous save
        return real(self, plan, planner)
    if sys.argv[2] == "write":  # in its worker, writing its shards
        dcp.FileSystemWriter.write_data = dies
    elif accelerator.process_index == 1:  # at its call, before it handed the save to its worker
        training_state.rng_states = lambda *args: os._exit(9)
    accelerator.save_state(sys.argv[1], async_save=True)
    started = time.monotonic()
    try:
        accelerator.wait_for_checkpoint()
        print("wait_for_checkpoint returned", flush=True)
    except Exception as error:
        print(f"raised after {time.monotonic() - started:.1f} s: {error}", flush=True)
    os._exit(0)  # the peer is gone: no orderly shutdown of the group
    """
)


@pytest.mark.parametrize("dies_in", ["write", "call"])
def test_the_survivor_of_a_process_killed_mid_asynchronous_save_raises_within_the_deadline(tmp_path, dies_in):
    """Rank 1 dies writing its shards, or at its call (rank 0's worker then waits for it to agree on the staging
    folder): rank 0 raises at its next join, the staging folder and the lock file are gone."""
    script = tmp_path / "job.py"
    script.write_text(SURVIVOR_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    outputs, jobs = two_processes(script, out / "ckpt", dies_in, extra_env={"ACCEL_PROCESS_GROUP_TIMEOUT": "10"})
    assert jobs[1].returncode == 9
    assert "raised after" in outputs[0][0], outputs[0]
    assert float(outputs[0][0].split("raised after ")[1].split(" s")[0]) < 60
    assert os.listdir(out) == ["ckpt"]  # the staging folder is gone; the previous checkpoint stays
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(os.listdir(out / "ckpt"))


FAILING_EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import torch.distributed.checkpoint as dcp
    from accel.accelerator import Accelerator
    from accel.backends.fsdp import FullyShardedDataParallelPlugin
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    real = dcp.FileSystemWriter.write_data
    def no_space(self, plan, planner):
        if accelerator.process_index == 1:
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)
    dcp.FileSystemWriter.write_data = no_space
    accelerator.save_state(sys.argv[1], async_save=True)
    print("script finished", flush=True)
    """
)


def test_a_failed_asynchronous_sharded_save_makes_every_process_exit_non_zero(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FAILING_EXIT_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    outputs, jobs = two_processes(script, out / "ckpt")
    assert [job.returncode for job in jobs] == [1, 1], outputs
    for stdout, stderr in outputs:
        assert "script finished" in stdout and "exiting with status 1" in stderr
    assert "No space left on device" in outputs[1][1]
    assert os.listdir(out) == []  # nothing published, the staging folder removed


def two_processes(script, *args, extra_env=None):
    """Runs `script` on 2 processes (as torchrun would start them); ([(stdout, stderr)], [Popen]) once both end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        **(extra_env or {}),
    }
    jobs = [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    try:
        return [job.communicate(timeout=120) for job in jobs], jobs
    finally:
        for job in jobs:
            job.kill()
