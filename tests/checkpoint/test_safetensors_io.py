"""safetensors files: round trips through the native writer/reader and the fallback (identical bytes), files
safetensors itself reads, complete header validation (with a fuzz), and a full disk."""

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file as reference_save_file

from accel import ops
from accel.checkpoint import atomic_files
from accel.checkpoint import safetensors_io as io
from accel.checkpoint.safetensors_io import CheckpointError


def every_dtype(generator):
    tensors = {}
    for name, dtype in io.DTYPES.items():
        if dtype == torch.bool:
            tensors[name] = torch.rand(5, 3, generator=generator) > 0.5
        elif dtype.is_floating_point or dtype.is_complex:
            tensors[name] = torch.randn(5, 3, generator=generator).to(dtype)
        else:
            tensors[name] = torch.randint(0, 100, (5, 3), generator=generator).to(dtype)
    return tensors


def sample_tensors():
    generator = torch.Generator().manual_seed(0)
    tensors = {f"dtype.{k}": v for k, v in every_dtype(generator).items()}
    base = torch.randn(6, 8, generator=generator)
    tensors.update(
        {
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "empty.int": torch.empty(3, 0, dtype=torch.int32),
            "transposed": base.t(),
            "sliced": base[::2, 1:5],
            "shares.a": base,
            "shares.b": base[1],  # a view of the same memory: written as its own copy
            "big": torch.randn(300_000, generator=generator),
        }
    )
    return tensors


def same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def test_round_trip_every_dtype_and_layout(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "model.safetensors"
    io.save_file(tensors, path, metadata={"format": "pt"})
    loaded = io.load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert same(loaded[name], tensor), name
    assert io.read_header(path).metadata == {"format": "pt"}
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left


def test_safetensors_reads_our_files_and_we_read_its_files(tmp_path):
    tensors = sample_tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    io.save_file(tensors, ours)
    with safe_open(ours, "pt") as f:
        assert set(f.keys()) == set(tensors)
        for name in f.keys():
            assert same(f.get_tensor(name), tensors[name]), name
    independent = {k: v.contiguous().clone() for k, v in tensors.items()}  # safetensors refuses shared memory
    reference_save_file(independent, theirs, metadata={"format": "pt"})
    loaded = io.load_file(theirs)
    assert all(same(loaded[name], tensor) for name, tensor in independent.items())


def test_data_is_aligned_to_each_element_size(tmp_path):
    path = tmp_path / "a.safetensors"
    io.save_file(
        {
            "byte": torch.ones(3, dtype=torch.uint8),
            "half": torch.ones(3, dtype=torch.float16),
            "double": torch.ones(3, dtype=torch.float64),
        },
        path,
    )
    header = io.read_header(path)
    data_start = min(info.begin for info in header.tensors.values())
    assert data_start % 8 == 0
    for info in header.tensors.values():
        assert (info.begin - data_start) % torch.empty((), dtype=info.dtype).element_size() == 0


@pytest.mark.native
def test_native_and_fallback_write_identical_files(tmp_path):
    tensors = sample_tensors()
    header, planned = io.plan_file(tensors, {"format": "pt"})
    staged = [(name, io._host_contiguous(tensor), offset) for name, tensor, offset in planned]
    native, python = tmp_path / "native", tmp_path / "python"
    fd = atomic_files.create_exclusive(str(native))
    try:
        ops.write_tensors_(
            fd,
            str(native),
            torch.frombuffer(bytearray(header), dtype=torch.uint8),
            [t for _, t, _ in staged],
            [o for _, _, o in staged],
        )
    finally:
        os.close(fd)
    fd = atomic_files.create_exclusive(str(python))
    try:
        io.write_parallel(fd, header, staged, durable=True)
    finally:
        os.close(fd)
    assert native.read_bytes() == python.read_bytes()


@pytest.mark.native
def test_native_read_into_matches_python_read(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    tensors = sample_tensors()
    io.save_file(tensors, path)
    native = io.load_file(path)
    monkeypatch.setattr(io._ext, "native_for", lambda op, device: False)
    python = io.load_file(path)
    assert all(same(native[name], python[name]) for name in tensors)


def test_read_into_converts_dtype_and_checks_shape(tmp_path):
    path = tmp_path / "m.safetensors"
    io.save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, path)
    header = io.read_header(path)
    target = torch.zeros(2, 3, dtype=torch.float16)
    io.read_into(header, {"w": target})
    assert target.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(CheckpointError, match=r"tensor 'w'.*shape \[2, 3\].*destination \[3, 2\]"):
        io.read_into(header, {"w": torch.zeros(3, 2)})


def test_an_existing_file_is_replaced_only_when_the_new_one_is_complete(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    io.save_file({"w": torch.ones(4)}, path)
    monkeypatch.setattr(io, "_host_contiguous", lambda t: (_ for _ in ()).throw(RuntimeError("interrupted")))
    with pytest.raises(RuntimeError, match="interrupted"):
        io.save_file({"w": torch.zeros(4)}, path)
    assert io.load_file(path)["w"].tolist() == [1, 1, 1, 1]
    assert os.listdir(tmp_path) == ["m.safetensors"]


# --- bad files -----------------------------------------------------------------------------------------------------


def write_raw(path, header: dict | bytes, data: bytes, length: int | None = None):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


GOOD = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "I8", "shape": [4], "data_offsets": [8, 12]},
}


@pytest.mark.parametrize(
    "header,data,length,message",
    [
        (GOOD, b"\0" * 11, None, r"tensor 'b'.*run past the end.*truncated"),
        (GOOD, b"\0" * 12, 10**6, r"header length 1000000 runs past the end"),
        (GOOD, b"\0" * 12, 10**9, r"exceeds the 100000000-byte limit"),
        (b"{not json", b"", None, r"not valid JSON"),
        (b"[1, 2]", b"", None, r"must be a JSON object"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            r"tensors 'a' and 'b' overlap",
        ),  # noqa: E501
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
            None,
            r"4 bytes before tensor 'a'",
        ),  # noqa: E501
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, None, r"4 bytes after the last"),  # noqa: E501
        (
            {"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"tensor 'a': unknown dtype 'Q7'",
        ),  # noqa: E501
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"tensor 'a': shape \[3\] of F32 needs 12 bytes",
        ),  # noqa: E501
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"non-negative integers"),  # noqa: E501
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, r"0 <= begin <= end"),  # noqa: E501
        ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, r"tensor 'a': expected exactly the keys"),
        ({"__metadata__": {"k": 1}}, b"", None, r"__metadata__ must map strings to strings"),
        ({"__metadata__": ["k", "v"]}, b"", None, r"__metadata__ must map strings to strings, got \['k', 'v'\]"),
        (
            {"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"tensor 'a': unknown dtype \['F32'\]",
        ),  # noqa: E501
        (
            {"a": {"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            r"tensor 'a': unknown dtype \{",
        ),  # noqa: E501
        (
            {"a": {"dtype": "F16", "shape": [0, 2**63], "data_offsets": [0, 0]}},
            b"",
            None,
            r"tensor 'a': shape \[0, 9223372036854775808\] is too large",
        ),  # noqa: E501
        (
            {"a": {"dtype": "F16", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}},
            b"",
            None,
            r"tensor 'a': shape .* is too large",
        ),  # noqa: E501
        (b"[" * 100_000, b"", None, r"not valid JSON"),
        (b'{"a": ' + b"9" * 5000 + b"}", b"", None, r"not valid JSON"),
    ],
)
def test_bad_files_raise_a_clear_error(tmp_path, header, data, length, message):
    path = write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CheckpointError, match=message) as caught:
        io.load_file(path)
    assert str(path) in str(caught.value)


def test_a_file_shorter_than_the_length_prefix(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than the 8-byte header length"):
        io.read_header(path)


def test_a_file_truncated_after_validation_fails_cleanly(tmp_path):
    """The reader re-checks lengths as it reads: a file cut between validation and reading is an error too."""
    path = tmp_path / "m.safetensors"
    io.save_file({"w": torch.randn(1000)}, path)
    header = io.read_header(path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises((CheckpointError, RuntimeError), match="truncated"):
        io.read_into(header, {"w": torch.empty(1000)})


VALID_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "I64", "BOOL", "U8", "XX", 3]),
        "shape": st.lists(st.integers(-2, 6), max_size=3) | st.text(max_size=3),
        "data_offsets": st.lists(st.integers(-4, 200), min_size=0, max_size=3),
    }
)
HEADERS = st.dictionaries(st.text(max_size=6), VALID_ENTRY | st.integers() | st.none() | st.text(), max_size=5)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=HEADERS, data_size=st.integers(0, 256))
def test_fuzz_structured_headers_only_ever_raise_checkpoint_error(header, data_size):
    raw = json.dumps(header).encode()
    try:
        parsed = io.parse_header("fuzz.safetensors", raw, 8 + len(raw) + data_size)
    except CheckpointError:
        return
    # Accepted: then it really is a complete, non-overlapping layout of the data.
    spans = sorted((info.begin, info.end) for info in parsed.tensors.values())
    position = 8 + len(raw)
    for begin, end in spans:
        assert begin == position
        position = end
    assert position == 8 + len(raw) + data_size


@settings(max_examples=2000, deadline=None)
@given(raw=st.binary(max_size=200), data_size=st.integers(0, 64))
def test_fuzz_arbitrary_bytes_only_ever_raise_checkpoint_error(raw, data_size):
    try:
        io.parse_header("fuzz.safetensors", raw, 8 + len(raw) + data_size)
    except CheckpointError:
        pass


# --- a full disk ---------------------------------------------------------------------------------------------------

FULL_DISK_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from accel.checkpoint import save_file
    folder = sys.argv[1]
    save_file({"small": torch.ones(10)}, os.path.join(folder, "ok.safetensors"))
    try:
        save_file({"big": torch.ones(2_000_000)}, os.path.join(folder, "big.safetensors"))  # 8 MB > 1 MiB
    except OSError as error:
        print("ERROR", error)
    print("FILES", sorted(os.listdir(folder)))
    """
)


@pytest.mark.parametrize(
    "native", [pytest.param(True, marks=pytest.mark.native, id="native"), pytest.param(False, id="fallback")]
)
def test_a_full_disk_is_a_clear_error_and_leaves_no_temporary_file(tmp_path, native):
    """A 1 MiB tmpfs, mounted in a user namespace of a child process (skipped where that is not allowed)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-Urm", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a mount namespace here (unshare -Urm)")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(FULL_DISK_SCRIPT)
    env = dict(os.environ, ACCEL_DISABLE_NATIVE="0" if native else "1")
    command = f"mount -t tmpfs -o size=1m tmpfs {mount_point} && exec {sys.executable} {script} {mount_point}"
    result = subprocess.run(
        [unshare, "-Urm", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=120
    )
    if "mount" in result.stderr and result.returncode != 0:
        pytest.skip(f"tmpfs mount refused: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "ERROR" in result.stdout and "No space left on device" in result.stdout, result.stdout
    assert "big.safetensors" in result.stdout.split("ERROR", 1)[1]  # the error names the file
    assert "FILES ['ok.safetensors']" in result.stdout  # the temporary file is gone, the earlier file intact


@pytest.mark.native
def test_native_bad_arguments_name_the_problem(tmp_path):
    header = torch.zeros(8, dtype=torch.uint8)
    with open(tmp_path / "x", "wb") as file:
        with pytest.raises(RuntimeError, match=r"tensors\[0\] is not contiguous"):
            ops.write_tensors_(file.fileno(), "x", header, [torch.ones(3, 3).t()], [0])
        with pytest.raises(RuntimeError, match="1 tensors but 2 offsets"):
            ops.write_tensors_(file.fileno(), "x", header, [torch.ones(3)], [0, 1])
    with pytest.raises(RuntimeError, match="fd must be an open file descriptor, got -1"):
        ops.read_tensors_(-1, "missing", [0], [torch.empty(3)])
    (tmp_path / "short").write_bytes(b"\0" * 100)
    with open(tmp_path / "short", "rb") as file:
        with pytest.raises(
            RuntimeError, match=r"'short' ended early \(tensor 1 needs bytes up to 140, the file has 100\)"
        ):
            ops.read_tensors_(file.fileno(), "short", [0, 60], [torch.empty(10), torch.empty(20)])
    assert (tmp_path / "x").stat().st_size == 0  # refused before any byte moved


@pytest.mark.native
def test_a_failed_system_call_of_the_native_ops_is_an_oserror_with_its_errno(tmp_path):
    """The ops return a failed call's errno as a value (their status), which the wrappers raise as OSError: nothing
    is parsed out of a message."""
    header = torch.zeros(8, dtype=torch.uint8)
    (tmp_path / "ro").write_bytes(b"")
    with open(tmp_path / "ro", "rb") as file:  # open for reading only: every write fails with EBADF
        with pytest.raises(OSError) as raised:
            ops.write_tensors_(file.fileno(), "ro", header, [torch.ones(3)], [0])
    assert raised.value.errno == errno.EBADF and raised.value.filename == "ro"
    (tmp_path / "wo").write_bytes(b"\0" * 64)
    fd = os.open(tmp_path / "wo", os.O_WRONLY)  # open for writing only: reads fail with EBADF, naming the tensor
    try:
        with pytest.raises(OSError, match=r"\(read, tensor 0\)") as raised:
            ops.read_tensors_(fd, "wo", [0], [torch.empty(4)])
    finally:
        os.close(fd)
    assert raised.value.errno == errno.EBADF


@pytest.mark.gpu
@pytest.mark.native_cuda
def test_gpu_tensors_stream_through_the_pinned_buffers(tmp_path):
    """Several 8 MiB chunks per tensor, so both buffers are reused; CPU and GPU tensors in one file."""
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "big": torch.randn(7_000_001, generator=generator).cuda(),
        "half": torch.randn(3_000_000, generator=generator).half().cuda(),
        "host": torch.randn(1000, generator=generator),
        "strided": torch.randn(300, 200, generator=generator).cuda().t(),
    }
    path = tmp_path / "gpu.safetensors"
    io.save_file(tensors, path)
    loaded = io.load_file(path)
    assert all(same(loaded[n], t.cpu()) for n, t in tensors.items())
    header = io.read_header(path)
    targets = {
        "big": torch.empty(7_000_001, device="cuda"),
        "half": torch.empty(3_000_000, dtype=torch.half, device="cuda"),
    }
    io.read_into(header, targets)
    assert all(same(targets[n].cpu(), tensors[n].cpu()) for n in targets)


@pytest.mark.gpu
@pytest.mark.native_cuda
@pytest.mark.parametrize("durable", [True, False])
def test_gpu_tensors_of_every_dtype_and_layout_make_the_same_file_as_cpu_tensors(tmp_path, durable):
    """The native writer's GPU path (durable) and the copy to the CPU (not durable) write byte for byte the file
    the CPU tensors make; the native reader fills GPU tensors of every dtype with the same bits."""
    tensors = sample_tensors()
    on_gpu = {name: t.cuda() for name, t in tensors.items()}
    io.save_file(tensors, tmp_path / "cpu.safetensors", durable=durable)
    io.save_file(on_gpu, tmp_path / "gpu.safetensors", durable=durable)
    assert (tmp_path / "gpu.safetensors").read_bytes() == (tmp_path / "cpu.safetensors").read_bytes()
    header = io.read_header(tmp_path / "gpu.safetensors")
    targets = {name: torch.empty(info.shape, dtype=info.dtype, device="cuda") for name, info in header.tensors.items()}
    io.read_into(header, targets)
    assert all(same(targets[name].cpu(), tensors[name]) for name in tensors)
    converted = {"big": torch.empty(300_000, dtype=torch.float64, device="cuda")}  # another dtype: through the CPU
    io.read_into(header, converted)
    assert torch.equal(converted["big"].cpu(), tensors["big"].double())
