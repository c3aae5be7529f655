"""accel::shm_all_gather and accel::shm_all_gather_bytes in one process (a group of one); opcheck: test_opcheck.py.

Several ranks are covered in tests/wire/test_shm_transport.py; here the results of a group of one, argument
checks and group handles.
"""

import os
import secrets

import pytest
import torch

pytestmark = pytest.mark.native


@pytest.fixture
def group():
    from accel import ops

    handle = ops.shm_group_create(0, 1, secrets.token_hex(16), 4096, 10.0)
    ops.shm_group_attach(handle, ops.shm_group_locator(handle))
    ops.shm_group_finish_setup(handle)
    yield handle
    ops.shm_group_destroy(handle)


SAMPLES = [
    [torch.arange(12, dtype=torch.float32).view(3, 4)],
    [torch.ones(5, dtype=torch.bool), torch.zeros(0, 2, dtype=torch.int64), torch.randn(3, 4, 5)[:, ::2]],
    [torch.randn(3000, 3)],  # several 4 KiB rounds
]


@pytest.mark.parametrize("leaves", SAMPLES)
def test_a_group_of_one_gathers_itself(group, leaves):
    from accel import ops

    gathered = ops.shm_all_gather(group, leaves)
    assert all(torch.equal(ours, leaf) for ours, leaf in zip(gathered, leaves))
    padded = ops.shm_all_gather(group, leaves, -1, 7, True)
    assert all(torch.equal(ours, leaf) for ours, leaf in zip(padded, leaves))


def test_a_group_of_one_gathers_its_bytes(group):
    data = torch.arange(10000, dtype=torch.int64).to(torch.uint8)
    gathered, lengths = torch.ops.accel.shm_all_gather_bytes.default(group, data, "gather_object")
    assert torch.equal(gathered, data) and lengths.tolist() == [10000]


@pytest.mark.parametrize("leaves", SAMPLES)
def test_a_group_of_one_pads_nothing(group, leaves):
    from accel import ops

    assert ops.shm_pad_across_processes(group, leaves, 0, 1, False) == ([], [])


def test_bad_arguments_name_the_problem(group):
    from accel import ops

    with pytest.raises(RuntimeError, match="0-d"):
        ops.shm_all_gather(group, [torch.tensor(1.0)])
    with pytest.raises(RuntimeError, match="1-d uint8"):
        ops.shm_all_gather_bytes(group, torch.zeros(3))
    with pytest.raises(RuntimeError, match="no group with handle"):
        ops.shm_all_gather(123456, [torch.ones(1)])
    with pytest.raises(RuntimeError, match="token"):
        ops.shm_group_create(0, 1, "not-hex", 4096, 1.0)
    with pytest.raises(RuntimeError, match="timeout"):
        ops.shm_group_create(0, 1, secrets.token_hex(16), 4096, 0.0)


def _mapped(name: str) -> list[str]:
    """The lines of /proc/self/maps that map the memfd `name`."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if f"/memfd:{name} " in line]


def test_a_segment_is_private_sealed_and_never_in_dev_shm():
    from accel import ops

    token = secrets.token_hex(16)
    handle = ops.shm_group_create(0, 1, token, 4096, 1.0)
    try:
        pid, fd = ops.shm_group_locator(handle)
        assert pid == os.getpid()
        info = os.stat(f"/proc/self/fd/{fd}")
        assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.getuid()
        assert not [name for name in os.listdir("/dev/shm") if token in name]
        assert len(_mapped(f"accel-{token}-r0")) == 1
        ops.shm_group_attach(handle, [pid, fd])
        ops.shm_group_finish_setup(handle)
        assert not os.path.exists(f"/proc/self/fd/{fd}") or token not in os.readlink(f"/proc/self/fd/{fd}")
        with pytest.raises(RuntimeError, match="no locator"):
            ops.shm_group_locator(handle)
    finally:
        ops.shm_group_destroy(handle)
    assert not _mapped(f"accel-{token}-r0")


def test_recycled_output_buffers_never_alias_live_tensors(group):
    """Outputs of >= 64 KiB come from a pool of buffers that freed outputs return to: a live output is never
    handed out again, a recycled one holds the new call's data, and pooled storage still resizes."""
    from accel import ops

    kept = []
    for step in range(6):
        leaf = torch.full((40_000,), step, dtype=torch.int32)  # 160 KB
        out = ops.shm_all_gather(group, [leaf])[0]
        assert torch.equal(out, leaf)
        if step % 2 == 0:
            kept.append((step, out))  # alive across the next calls; the odd steps' outputs are freed at once
    for step, out in kept:
        assert torch.equal(out, torch.full((40_000,), step, dtype=torch.int32))
    assert len({out.data_ptr() for _, out in kept}) == len(kept)
    grown = ops.shm_all_gather(group, [torch.ones(70_000)])[0]
    grown.resize_(200_000)
    assert torch.equal(grown[:70_000], torch.ones(70_000))


# --- the direct entry (accel._C's functions, the eager path) against the op (torch.ops) ----------------------------


def _raised(call) -> tuple[type, str]:
    with pytest.raises(Exception) as raised:
        call()
    return raised.type, str(raised.value).split("\nException raised from", 1)[0]


@pytest.mark.parametrize("leaves", SAMPLES)
def test_the_direct_entry_returns_what_the_op_returns(group, leaves):
    from accel import _C

    for pad in [(None, 0, False), (0, 7, True), (-1, 2.5, False), (0, True, False)]:
        direct = _C.shm_all_gather(group, leaves, *pad, "gather")
        dispatched = torch.ops.accel.shm_all_gather.default(group, leaves, *pad, "gather")
        assert [(t.dtype, t.shape, t.stride()) for t in direct] == [(t.dtype, t.shape, t.stride()) for t in dispatched]
        assert all(torch.equal(a, b) for a, b in zip(direct, dispatched))
    assert _C.shm_pad_across_processes(group, leaves, 0, 1, False) == ([], [])
    data = torch.arange(300, dtype=torch.int64).to(torch.uint8)
    direct, dispatched = (
        _C.shm_all_gather_bytes(group, data, "x"),
        torch.ops.accel.shm_all_gather_bytes.default(group, data, "x"),
    )
    assert all(torch.equal(a, b) for a, b in zip(direct, dispatched))


def test_the_direct_entry_raises_what_the_op_raises(group):
    from accel import _C

    zero_d = [torch.tensor(1.0)]
    assert _raised(lambda: _C.shm_all_gather(group, zero_d, None, 0, False, "gather")) == _raised(
        lambda: torch.ops.accel.shm_all_gather.default(group, zero_d, None, 0, False, "gather")
    )
    assert _raised(lambda: _C.shm_all_gather_bytes(123456, torch.ones(1, dtype=torch.uint8), "x")) == _raised(
        lambda: torch.ops.accel.shm_all_gather_bytes.default(123456, torch.ones(1, dtype=torch.uint8), "x")
    )
    with pytest.raises(TypeError, match="padding value must be a bool, int or float, got str"):
        _C.shm_pad_across_processes(group, [torch.ones(2)], 0, "7", False)


class _Subclass(torch.Tensor):
    pass


def test_the_eager_path_is_taken_only_where_nothing_sees_ops(monkeypatch):
    """ops' wrappers call the direct entry only for plain tensors with nothing tracing: fake tensors, modes and
    torch.compile must meet the op (its fake kernel), or a traced program would run a real collective."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from accel import ops

    plain = torch.ones(2)
    assert ops._eager([plain]) and ops._eager([plain, plain], 0.5) and ops._eager([], True)
    assert not ops._eager([plain], torch.tensor(1))  # a fill value only the op reads
    assert not ops._eager([plain.as_subclass(_Subclass)])
    assert not ops._eager([torch.nn.Parameter(plain)])
    with FakeTensorMode() as mode:
        assert not ops._eager([plain])
        assert not ops._eager([mode.from_tensor(plain)])
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not ops._eager([plain])
    assert ops._eager([plain])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what torch.compile's tracing sees
    assert not ops._eager([plain])
