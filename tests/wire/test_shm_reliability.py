"""The shared-memory transport when things go wrong (issue 12): peers that publish garbage, ranks that call
different collectives, a rank that leaves or dies (setup included), threads sharing a group, forked workers.

Every wait is bounded; /dev/shm must stay empty (the conftest guard checks it too).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import secrets
import signal
import struct
import threading
import time

import pytest
import torch
from separate_ranks import run_separate_ranks
from spawn_pool import run_on_ranks

from accel.collectives import DistributedOperationException, gather, gather_object, pad_across_processes
from accel.state import PartialState
from accel.wire.transport_selection import select_transport

pytestmark = pytest.mark.native

SLOT = 4096
PAGE = 4096  # the control block's page; the slots follow (csrc/shm/control_block.h)
PUBLISHED = 64  # offset of the `published` counter in the control block
NO_PAD_DIM = -(2**63)


def _shm():
    PartialState()
    transport = select_transport([])
    assert type(transport).__name__ == "SharedMemoryTransport", transport
    return transport


# --- a peer that publishes garbage -------------------------------------------------------------------------------


def _mapping_of(name: str) -> int:
    """The address at which this process maps the memfd `name`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(f"/memfd:{name} (deleted)"):
                return int(line.split("-", 1)[0], 16)
    raise AssertionError(f"{name} is not mapped")


def _call_words(kind: int, name: str) -> list[int]:
    """The fixed words of a meta (csrc/shm_bindings/shm_transport.cpp): kind, pad dim, pad first, name, count."""
    packed = name.encode().ljust(32, b"\0")
    return [kind, NO_PAD_DIM, 0, *struct.unpack("<4q", packed)]


GATHER, BYTES = 1, 2
FLOAT = 6  # at::ScalarType::Float
# (what the fake peer publishes as round 1: meta words, data size; which op the real rank calls)
GARBAGE = {
    "ndim beyond the meta": (_call_words(GATHER, "gather") + [1, FLOAT, 1 << 40, 3], 12, "gather"),
    "unknown dtype code": (_call_words(GATHER, "gather") + [1, 99, 1, 3], 12, "gather"),
    "negative size": (_call_words(GATHER, "gather") + [1, FLOAT, 1, -3], 12, "gather"),
    "leaf count beyond the meta": (_call_words(GATHER, "gather") + [1 << 60], 0, "gather"),
    "data size not the tensors' bytes": (_call_words(GATHER, "gather") + [1, FLOAT, 1, 1000], 8, "gather"),
    "sizes whose bytes overflow": (_call_words(GATHER, "gather") + [1, FLOAT, 2, 1 << 62, 1 << 62], 8, "gather"),
    "data size that wraps a sum": (_call_words(BYTES, "gather_object") + [0], 2**64 - 100, "bytes"),
    "unknown collective kind": ([7, NO_PAD_DIM, 0, 0, 0, 0, 0, 0], 0, "bytes"),
}


def _fake_peer_reports(connection) -> None:
    """In a fresh process: for each GARBAGE case, rank 0 of a 2-rank group gathers while rank 1 (a fake whose
    round 1 is written straight into its segment) publishes the garbage. Sends {case: (error, error after)}."""
    from accel import ops

    reports = {}
    for case, (words, data_size, op) in GARBAGE.items():
        token = secrets.token_hex(16)
        real, fake = (ops.shm_group_create(rank, 2, token, SLOT, 5.0) for rank in (0, 1))
        locators = ops.shm_group_locator(real) + ops.shm_group_locator(fake)
        for handle in (real, fake):
            ops.shm_group_attach(handle, locators)
        for handle in (real, fake):
            ops.shm_group_finish_setup(handle)
        base = _mapping_of(f"accel-{token}-r1")
        meta = struct.pack(f"<{len(words)}q", *words)
        round_one = struct.pack("<QQ", len(meta), data_size) + meta
        ctypes.memmove(base + PAGE + SLOT, round_one, len(round_one))  # round 1 uses slot 1
        ctypes.c_uint64.from_address(base + PUBLISHED).value = 1
        outcome = []
        for _ in range(2):  # the failing call, then the next one on the poisoned group
            try:
                if op == "gather":
                    ops.shm_all_gather(real, [torch.ones(3)])
                else:
                    ops.shm_all_gather_bytes(real, torch.ones(5, dtype=torch.uint8))
                outcome.append(None)
            except RuntimeError as error:
                outcome.append(str(error).splitlines()[0])
        reports[case] = tuple(outcome)
        ops.shm_group_destroy(real)
        ops.shm_group_destroy(fake)
    connection.send(reports)


def test_a_peer_publishing_garbage_is_reported_as_a_corrupt_header_naming_it():
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_fake_peer_reports, args=(sender,), daemon=True)
    process.start()
    deadline = time.monotonic() + 120
    while process.is_alive() and not receiver.poll(0.1) and time.monotonic() < deadline:
        pass
    reports = receiver.recv() if receiver.poll() else None
    process.join(30)
    assert process.exitcode == 0, f"the process reading the garbage died (exit code {process.exitcode})"
    assert reports is not None
    for case, (first, after) in reports.items():
        assert first is not None and "corrupt header from rank 1" in first, (case, first)
        assert after is not None and "earlier failure" in after and "rank 1" in after, (case, after)


# --- ranks that call different collectives -----------------------------------------------------------------------


def _different_collectives(pairing: str):
    rank = PartialState().process_index
    _shm()
    calls = {
        "gather/gather_object": (lambda: gather(torch.ones(2)), lambda: gather_object(["x"])),
        "pad_across_processes/wait_for_everyone": (
            lambda: pad_across_processes(torch.ones(2)),
            lambda: PartialState().wait_for_everyone(),
        ),
    }[pairing]
    try:
        calls[rank]()
        message = None
    except DistributedOperationException as error:
        message = str(error)
    return message, gather(torch.tensor([rank])).tolist()  # the group still works


@pytest.mark.parametrize("pairing", ["gather/gather_object", "pad_across_processes/wait_for_everyone"])
def test_ranks_calling_different_collectives_raise_naming_each_call(pairing):
    (first, after_0), (second, after_1) = run_on_ranks(_different_collectives, 2, pairing, timeout=60)
    names = pairing.split("/")
    assert first == second and first is not None
    assert f"process 0: {names[0]}" in first and f"process 1: {names[1]}" in first, first
    assert after_0 == after_1 == [0, 1]


# --- a rank that leaves the group --------------------------------------------------------------------------------


def _leave_while_peer_waits():
    rank = PartialState().process_index
    _shm()
    if rank == 0:
        time.sleep(0.3)
        torch.distributed.destroy_process_group()  # its shared-memory group goes with it; this process goes on
        return None
    started = time.monotonic()
    try:
        gather(torch.ones(2))
    except RuntimeError as error:
        return time.monotonic() - started, str(error).splitlines()[0]
    return None


def test_a_destroyed_group_fails_a_waiting_peer_at_once(monkeypatch):
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "120")
    _, (elapsed, message) = run_on_ranks(_leave_while_peer_waits, 2, timeout=60)
    assert "rank 0 aborted: its process group was shut down" in message and elapsed < 10, (elapsed, message)


# --- several threads on one group ---------------------------------------------------------------------------------


@pytest.fixture
def group_of_one():
    from accel import ops

    token = secrets.token_hex(16)
    handle = ops.shm_group_create(0, 1, token, SLOT, 30.0)
    ops.shm_group_attach(handle, ops.shm_group_locator(handle))
    ops.shm_group_finish_setup(handle)
    yield handle, token
    ops.shm_group_destroy(handle)


def test_threads_sharing_a_group_take_turns(group_of_one):
    """The collectives release the GIL while they wait; calls from several threads must not interleave inside
    the core (one round counter, one pair of slots), or results mix up."""
    from accel import ops

    handle, _ = group_of_one
    failures = []

    def hammer(seed):
        leaves = [torch.full((3000,), seed, dtype=torch.int32), torch.arange(seed, seed + 700, dtype=torch.int64)]
        for _ in range(300):
            out = ops.shm_all_gather(handle, leaves)
            if not all(torch.equal(o, leaf) for o, leaf in zip(out, leaves)):
                failures.append(seed)
                return

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads) and not failures


# --- forked DataLoader workers -----------------------------------------------------------------------------------


class _MappingSeen(torch.utils.data.Dataset):
    """Each item: whether the worker process that loads it maps the memfd `name`, and whether it is the parent."""

    def __init__(self, name: str):
        self.name, self.parent = name, os.getpid()

    def __len__(self):
        return 2

    def __getitem__(self, index):
        with open("/proc/self/maps") as maps:
            seen = any(f"/memfd:{self.name} " in line for line in maps)
        return torch.tensor([seen, os.getpid() == self.parent])


def test_forked_dataloader_workers_inherit_no_mapping(group_of_one):
    _, token = group_of_one
    name = f"accel-{token}-r0"
    assert _MappingSeen(name)[0].tolist() == [True, True]  # the parent maps it
    loader = torch.utils.data.DataLoader(
        _MappingSeen(name), batch_size=1, num_workers=1, multiprocessing_context="fork"
    )
    assert [batch.tolist() for batch in loader] == [[[False, False]]] * 2


def test_a_forked_child_cannot_use_the_group(group_of_one):
    from accel import ops

    handle, _ = group_of_one
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running any of the parent's cleanup
        try:
            ops.shm_all_gather(handle, [torch.ones(2)])
            message = b"no error"
        except RuntimeError as error:
            message = str(error).encode()
        os.write(write, message[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and "forked" in message, (status, message)
    assert torch.equal(ops.shm_all_gather(handle, [torch.ones(2)])[0], torch.ones(2))  # the parent's group works


# --- a rank killed while the transport is being set up -----------------------------------------------------------


def _dies_in_setup(rank: int, world_size: int, port: int, sig: int, report_dir: str) -> None:
    """One rank of a 2-rank job; rank 1 records the group's token and kills itself with `sig` right after
    creating its segment, inside the set-up window (before every peer has attached)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ACCEL_PROCESS_GROUP_TIMEOUT="12",  # the survivor waits this long for its dead peer (a store wait)
    )
    from accel import ops

    if rank == 1:
        create = ops.shm_group_create

        def create_then_die(*args, **kwargs):
            handle = create(*args, **kwargs)
            with open(os.path.join(report_dir, "token"), "w") as file:
                file.write(args[2])
            os.kill(os.getpid(), sig)
            time.sleep(30)  # not reached: the signal's default action ends the process
            return handle

        ops.shm_group_create = create_then_die
    try:
        PartialState()
        select_transport([])
    except Exception:  # rank 0 fails to set up (its peer is gone): what matters is what it leaves
        pass


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_rank_killed_during_transport_setup_leaves_nothing_in_dev_shm(tmp_path, sig):
    ranks, hung = run_separate_ranks(_dies_in_setup, 2, sig, str(tmp_path))
    token = (tmp_path / "token").read_text()
    left = [name for name in os.listdir("/dev/shm") if token in name]
    for name in left:  # before the check fails: leave the machine clean
        os.unlink(os.path.join("/dev/shm", name))
    assert ranks[1].exitcode == -sig
    assert not hung, "a surviving rank did not return within 90 s"
    assert not left, f"left in /dev/shm: {left}"
