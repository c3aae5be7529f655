"""The same-host shared-memory transport against the torch.distributed reference, on real ranks.

Parity is bit for bit: every rank runs each collective through both transports and compares the bytes.
Stress and failure tests bound every wait and check that /dev/shm is left empty (the conftest guard does too).
"""

import os
import signal
import threading
import time

import pytest
import torch
from separate_ranks import run_separate_ranks
from spawn_pool import run_on_ranks

from accel.collectives import DistributedOperationException
from accel.state import PartialState
from accel.wire.padding import pad_reference
from accel.wire.transport import TorchDistributedTransport
from accel.wire.transport_selection import select_transport

pytestmark = pytest.mark.native

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _values(dtype, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
        values.view(-1)[:1] = float("nan")  # NaN bits travel as they are
        return values.to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=generator).to(dtype)


def _shm():
    PartialState()  # joins the process group
    transport = select_transport([])
    assert type(transport).__name__ == "SharedMemoryTransport", transport
    return transport


def _parity_on_rank():
    """Failures of gather / ragged gather / padded gather / shapes / reduce / broadcast / objects vs the reference."""
    from accel import ops

    rank = PartialState().process_index
    shm, reference = _shm(), TorchDistributedTransport()
    failures = []
    for index, dtype in enumerate(DTYPES):
        leaves = [
            _values(dtype, (3, 5), index * 10 + rank),
            _values(dtype, (4, 2, 3), index)[:, ::2],  # strided
            _values(dtype, (0, 7), rank),
        ]
        for ours, theirs in zip(shm.all_gather(leaves), reference.all_gather(leaves)):
            if not _same_bits(ours, theirs):
                failures.append(f"all_gather {dtype}")
        ragged = [_values(dtype, (rank + 1, 2), rank), _values(dtype, (2 * rank, 3), rank)]
        for ours, theirs in zip(shm.all_gather_ragged(ragged), reference.all_gather_ragged(ragged)):
            if not _same_bits(ours, theirs):
                failures.append(f"all_gather_ragged {dtype}")
        failures += _padded_parity(ops, shm, dtype, rank)
        if dtype != torch.complex64:
            failures += _reduce_parity(shm, reference, dtype, index)
        target = _values(dtype, (2, 3), rank)
        expected = _values(dtype, (2, 3), 1)
        shm.broadcast([target], src=1)
        if not _same_bits(target, expected):
            failures.append(f"broadcast {dtype}")
    failures += _padded_leaves_parity(ops, shm, rank)
    if shm.all_gather_object({"rank": rank}) != [{"rank": r} for r in range(PartialState().num_processes)]:
        failures.append("all_gather_object")
    if shm.broadcast_object_list([rank, None], src=1) != [1, None]:
        failures.append("broadcast_object_list")
    return failures


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, except that a NaN may be any NaN (kernels differ in the NaN they return: torch's vectorized
    maximum gives an all-ones one, gloo's the input's)."""
    if not a.is_floating_point():
        return _same_bits(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and _same_bits(a[~nan], b[~nan])


def _reduce_parity(shm, reference, dtype, index):
    """Ours is the process group's reduction, the left-to-right fold over ranks (so NaN propagates, as in
    torch.maximum; fp16/bf16 in fp32); integer and bool results must also equal gloo's bit for bit (floating-point
    ones differ from gloo's order in the last bits)."""
    world, rank = PartialState().num_processes, PartialState().process_index
    parts = [_values(dtype, (3, 5), index * 10 + r) for r in range(world)]
    failures = []
    for op in ("sum", "max", "min"):
        ours = shm.all_reduce([parts[rank]], op)[0]
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # rounded once, at the end
        expected = parts[0].to(wide)
        for part in parts[1:]:
            if dtype == torch.bool:
                expected = expected & part if op == "min" else expected | part
            else:
                expected = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op](expected, part.to(wide))
        expected = expected.to(dtype)
        exact = not (dtype.is_floating_point or dtype.is_complex)
        if not _same_values(ours, expected) or (
            exact and not _same_bits(ours, reference.all_reduce([parts[rank]], op)[0])
        ):
            failures.append(f"all_reduce {op} {dtype}")
    return failures


def _padded_parity(ops, shm, dtype, rank):
    failures = []
    world = PartialState().num_processes
    for dim, pad_first, pad_value in [(0, False, 0), (1, True, 7), (-1, False, 1), (2, True, -3)]:
        shape = [2, 3, 4]
        shape[dim] = rank + 1
        leaf = _values(dtype, shape, rank)
        ours = ops.shm_all_gather(shm.handle, [leaf], dim, pad_value, pad_first)[0]
        shapes = [list(s[0]) for s in shm.all_gather_shapes([leaf])]
        largest = max(s[dim] for s in shapes)
        padded = pad_reference(leaf, dim, largest, pad_value, pad_first)
        theirs = TorchDistributedTransport().all_gather_ragged([padded])[0]
        if not _same_bits(ours, theirs):
            failures.append(f"padded gather dim={dim} pad_first={pad_first} {dtype} on {world} ranks")
    return failures


def _padded_leaves_parity(ops, shm, rank):
    """Several leaves in one padded gather: each padded with the pad value in its own dtype, blocks of ranks with
    different row counts, a leaf with a zero-size dim; dims 0 (padding rows) and 1 (padding inside every row)."""
    world = PartialState().num_processes
    failures = []
    for dim, pad_first in [(0, True), (1, False), (1, True)]:
        rows = rank + 2 if dim else 2  # padding along dim 1, the ranks' row counts may differ too
        shapes = [[rows, 3, 3], [rows, 4], [rows, 2, 0]]
        for shape in shapes:
            shape[dim] = rank + 1
        leaves = [_values(dtype, shape, rank) for dtype, shape in zip((torch.int16, torch.float64, torch.bool), shapes)]
        ours = ops.shm_all_gather(shm.handle, leaves, dim, -2, pad_first)
        largest = [max(s[dim] for s in shapes) for shapes in zip(*shm.all_gather_shapes(leaves))]
        padded = [pad_reference(leaf, dim, size, -2, pad_first) for leaf, size in zip(leaves, largest)]
        for index, (mine, theirs) in enumerate(zip(ours, TorchDistributedTransport().all_gather_ragged(padded))):
            if not _same_bits(mine, theirs):
                failures.append(
                    f"padded gather of several leaves: leaf {index} dim={dim} pad_first={pad_first} on {world} ranks"
                )
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_matches_the_reference_bit_for_bit(world_size):
    for rank, failures in enumerate(run_on_ranks(_parity_on_rank, world_size, timeout=120)):
        assert not failures, f"rank {rank}: {failures}"


def _mismatch_on_rank(kind):
    shm = _shm()
    rank = PartialState().process_index
    leaf = {
        "ndim": torch.zeros([2] * (rank + 1)),
        "dtype": torch.zeros(2, dtype=torch.float32 if rank else torch.int32),
        "count": None,
    }[kind]
    leaves = [torch.zeros(2)] * (rank + 1) if kind == "count" else [leaf]
    try:
        shm.all_gather(leaves)
    except DistributedOperationException as error:  # HF's type for ranks that disagree
        return str(error).splitlines()[0]
    return None


@pytest.mark.parametrize("kind", ["ndim", "dtype", "count"])
def test_disagreeing_ranks_raise_the_same_error_on_every_rank(kind):
    messages = run_on_ranks(_mismatch_on_rank, 2, kind, timeout=60)
    assert messages[0] is not None and messages == [messages[0]] * 2
    assert "process 0" in messages[0] and "process 1" in messages[0]


def _forced_transport():
    PartialState()
    return type(select_transport([])).__name__


def test_accel_transport_forces_the_choice(monkeypatch):
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")
    assert run_on_ranks(_forced_transport, 2) == ["TorchDistributedTransport"] * 2
    monkeypatch.setenv("ACCEL_TRANSPORT", "shm")
    assert run_on_ranks(_forced_transport, 2) == ["SharedMemoryTransport"] * 2


def _stress_on_rank(rounds):
    """Random sizes (crossing the 4 KiB slots) and random delays; every rank checks every byte."""
    shm = _shm()
    rank, world = PartialState().process_index, PartialState().num_processes
    plan = torch.Generator().manual_seed(1234)  # the same plan on every rank
    delays = torch.Generator().manual_seed(rank)
    for step in range(rounds):
        sizes = torch.randint(0, 3000, (world,), generator=plan).tolist()
        if torch.rand(1, generator=delays).item() < 0.05:
            time.sleep(torch.rand(1, generator=delays).item() * 0.003)
        mine = (torch.arange(sizes[rank], dtype=torch.int32) + step * 7 + rank) * (rank + 1)
        gathered = shm.all_gather_ragged([mine])[0]
        expected = torch.cat(
            [(torch.arange(n, dtype=torch.int32) + step * 7 + r) * (r + 1) for r, n in enumerate(sizes)]
        )
        if not torch.equal(gathered, expected):
            return f"round {step}: wrong data"
    return None


@pytest.mark.parametrize("world_size", [2, 4])
def test_thousands_of_rounds_with_random_sizes_and_delays(monkeypatch, world_size):
    monkeypatch.setenv("ACCEL_SHM_SLOT_BYTES", "4096")  # most payloads take several rounds
    assert run_on_ranks(_stress_on_rank, world_size, 1500, timeout=240) == [None] * world_size


def _killed_mid_call(rank, world_size, port, report_dir):
    """One rank of a job outside the spawn pool (whose fail-fast would stop the survivors before they report)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ACCEL_SHM_SLOT_BYTES="4096",
        ACCEL_PROCESS_GROUP_TIMEOUT="60",
    )
    shm = _shm()
    payload = torch.zeros(64 << 20, dtype=torch.uint8)  # 64 MiB in 4 KiB rounds: the kill lands mid-call
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    started = time.monotonic()
    try:
        while True:
            shm.all_gather([payload])
    except RuntimeError as error:
        with open(os.path.join(report_dir, f"rank{rank}"), "w") as file:
            file.write(f"{time.monotonic() - started:.3f}\n{error}")


def test_a_rank_killed_mid_call_makes_the_others_raise_naming_it(tmp_path):
    _, hung = run_separate_ranks(_killed_mid_call, 3, str(tmp_path))
    assert not hung, "a surviving rank did not return within 90 s"
    reports = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert set(reports) == {"rank0", "rank2"}, reports
    for report in reports.values():
        elapsed, message = report.split("\n", 1)
        assert "rank 1" in message and float(elapsed) < 15, report
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("accel-")]


def _gather_then_barrier():
    """A rejected gather (ranks disagree) raises on every rank and leaves the group usable."""
    from accel.collectives import gather_ragged

    rank = PartialState().process_index
    _shm()
    try:
        gather_ragged(torch.zeros(2, 3 + rank))
    except DistributedOperationException as error:
        message = str(error).splitlines()[0]
    else:
        message = None
    PartialState().wait_for_everyone()
    after = gather_ragged(torch.full((1,), float(rank)))
    return message, after.tolist()


def test_a_rejected_gather_leaves_the_group_usable():
    (message_0, after_0), (message_1, after_1) = run_on_ranks(_gather_then_barrier, 2, timeout=60)
    assert message_0 is not None and message_0 == message_1 and "process 1" in message_0
    assert after_0 == after_1 == [0.0, 1.0]


def _broadcast_objects_keeps_the_source_s():
    item = {"rank": PartialState().process_index}
    objects = [item]
    _shm().broadcast_object_list(objects, src=0)
    return objects[0] is item, objects[0]


def test_broadcast_object_list_leaves_the_source_s_objects_alone():
    (same_0, value_0), (same_1, value_1) = run_on_ranks(_broadcast_objects_keeps_the_source_s, 2)
    assert same_0 and not same_1 and value_0 == value_1 == {"rank": 0}
