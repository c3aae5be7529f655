"""safetensors files, written and read by accel's native byte mover or by a pure-Python fallback (same bytes).

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of
JSON (`{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`, padded with
spaces so the data starts 8-byte aligned), then the data, every byte of it owned by exactly one tensor.

Python plans the header and the offsets (tensors ordered by decreasing element size, then name, so every
tensor starts aligned to its element size) and validates every header it reads completely before touching
data: lengths, offsets inside the file, no overlaps or holes, known dtypes, shapes matching byte counts. The
native ops (`accel::write_tensors_` / `accel::read_tensors_`) then move every tensor's bytes with parallel
pwrite/pread straight from/to the tensors' memory. Files are written under a temporary name (fsync'd when the
save is durable) and renamed, so a reader never sees a partial file. A reader opens a file once and reads its
header and data through that descriptor (`SafetensorsFile`), so a file replaced meanwhile is never mixed in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from accel import _ext, ops
from accel.checkpoint.atomic_files import rename_into_place, write_temporary_fd
from accel.wire.byte_views import byte_view, dense_values

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_CANDIDATE_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _CANDIDATE_DTYPES.items() if hasattr(torch, attr)
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as what it claims to be; the message names the file and tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # file offset of the first byte
    end: int  # file offset past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


# --- writing -------------------------------------------------------------------------------------------------------


def plan_file(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[str, torch.Tensor, int]]]:
    """The header bytes (length prefix included) and (name, tensor, offset in the data section) in file order."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"cannot save '{name}': expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype not in NAMES:
            raise TypeError(f"cannot save '{name}': safetensors has no dtype for {tensor.dtype}")
        if tensor.layout != torch.strided:
            raise TypeError(f"cannot save '{name}': only dense tensors can be saved, it is {tensor.layout}")
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    planned, offset = [], 0
    for name in order:
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        planned.append((name, tensor, offset))
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, planned


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    durable: bool = True,
) -> None:
    """Writes `tensors` to `path` as safetensors: into a new temporary file in the same folder, renamed over `path`
    once complete, so a reader (or a process killed meanwhile) sees the old file or the new one, never a part.

    `durable=True` fsyncs the file before the rename and the folder after it (the file survives a power loss
    once this returns); `durable=False` leaves the bytes in the page cache, as safetensors and HF do (a process
    kill cannot lose them, a power loss can): the caller makes them durable later (accel.checkpoint.background).
    Non-contiguous tensors are made contiguous first; GPU tensors stream through the native writer's pinned
    buffers (or are copied to the CPU first without it). On any failure (a full disk included) the temporary
    file is removed and the error names the file.
    """
    path = os.fspath(path)
    rename_into_place(write_temporary(tensors, path, metadata, durable=durable), path, durable)


def write_temporary(
    tensors: Mapping[str, torch.Tensor], path: str, metadata: Mapping[str, str] | None = None, *, durable: bool = True
) -> str:
    """Writes `tensors` as safetensors into a new temporary file next to `path` and returns its name (see
    `save_file`; the caller renames it). Durable writes go through the native writer (parallel pwrite, early
    writeback, fsync); the others through parallel pwrite from Python threads (the time is in the kernel)."""
    header, planned = plan_file(tensors, metadata)
    native = durable and _ext.native_for("write_tensors_", "cpu")
    staged = [(name, _staged(tensor, native), offset) for name, tensor, offset in planned]

    def write(fd: int) -> None:
        if native:
            ops.write_tensors_(
                fd,
                path,
                torch.frombuffer(bytearray(header), dtype=torch.uint8),
                [t for _, t, _ in staged],
                [o for _, _, o in staged],
            )
        else:
            write_parallel(fd, header, staged, durable)

    try:
        return write_temporary_fd(path, write)
    except OSError as error:
        raise OSError(error.errno, f"cannot write '{path}': {error.strerror or error}") from error


def _host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return dense_values(tensor.detach().to("cpu"))  # the writers copy memory: view bits resolved


def _staged(tensor: torch.Tensor, native: bool) -> torch.Tensor:
    """What the writer reads from: the tensor itself when it can (contiguous, on a device with a kernel)."""
    if native and tensor.device.type == "cuda" and _ext.native_for("write_tensors_", tensor.device):
        return dense_values(tensor)
    return _host_contiguous(tensor)


def _readable_in_place(target: torch.Tensor, dtype: torch.dtype) -> bool:
    if target.dtype != dtype or not target.is_contiguous() or target.is_conj() or target.is_neg():
        return False
    if target.device.type == "cpu":
        return True
    return target.device.type == "cuda" and _ext.native_for("read_tensors_", target.device)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (it is contiguous and on the CPU)."""
    return memoryview(byte_view(tensor).numpy())


_CHUNK_BYTES = 8 << 20  # as the native writer: large for the disk, small enough to spread over threads
_writers: ThreadPoolExecutor | None = None
_writers_lock = threading.Lock()


def write_parallel(fd: int, header: bytes, staged: list[tuple[str, torch.Tensor, int]], durable: bool) -> None:
    """pwrite of the header and every tensor's bytes (8 MiB chunks over a few threads: pwrite releases the GIL),
    then fsync when `durable`. The tensors are contiguous CPU tensors; offsets count from the end of the header."""
    _pwrite_all(fd, memoryview(header), 0)
    chunks = [
        (view[start : start + _CHUNK_BYTES], len(header) + offset + start)
        for _, tensor, offset in staged
        if tensor.numel()
        for view in (_bytes_of(tensor),)
        for start in range(0, len(view), _CHUNK_BYTES)
    ]
    if len(chunks) > 1:
        for _ in _writer_pool().map(lambda chunk: _pwrite_all(fd, *chunk), chunks):
            pass
    elif chunks:
        _pwrite_all(fd, *chunks[0])
    if durable:
        os.fsync(fd)


def _writer_pool() -> ThreadPoolExecutor:
    global _writers
    with _writers_lock:
        if _writers is None:
            _writers = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="accel-pwrite")
        return _writers


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


# --- reading -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """Which file, at which content: the device and inode say which file a name led to, size and mtime whether it
    was rewritten in place since."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


@dataclasses.dataclass(frozen=True)
class Header:
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]  # in file order
    identity: FileIdentity | None = None  # of the file the header was read from


class FileChangedError(CheckpointError):
    """The file was replaced, truncated or rewritten between reading its header and reading its data."""


def _changed(path: str, then: FileIdentity, now: FileIdentity) -> FileChangedError:
    if (then.device, then.inode) != (now.device, now.inode):
        what = "was replaced by another file"
    elif now.size < then.size:
        what = f"was truncated ({then.size} -> {now.size} bytes)"
    else:
        what = "was rewritten in place"
    return FileChangedError(
        f"'{path}' {what} after its header was read: another process is writing it. Load it "
        "again once that writer is done (writers that write a new file and rename it, as "
        "accel, safetensors and transformers do, never disturb a reader)"
    )


class SafetensorsFile:
    """A safetensors file opened once: its header is validated and its data read through the same descriptor, so
    that a file replaced meanwhile (an atomic rename by a writer) cannot lend its bytes to another file's header.
    A file rewritten in place while it is read is detected (size or mtime moved) and raises FileChangedError.

    Use as a context manager; `header` is validated on opening.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.header = _read_header_from(self.fd, self.path)
        except BaseException:
            os.close(self.fd)
            raise

    def read_into(self, targets: Mapping[str, torch.Tensor]) -> None:
        """As the module's `read_into`, through this file's descriptor."""
        _read_into(self.header, targets, self.fd)

    def check_unchanged(self) -> None:
        """Raises FileChangedError when the file's size or mtime moved since its header was read."""
        _check_unchanged(self.fd, self.header)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_header(path: str | os.PathLike) -> Header:
    """Parses and fully validates the header of the safetensors file at `path`; touches no tensor data.

    The header records the file's identity, so that a later `read_into(header, ...)` fails instead of reading
    another file's bytes when the file was replaced or rewritten in between. Readers that open, validate and read
    in one go use `SafetensorsFile`."""
    with SafetensorsFile(path) as f:
        return f.header


def _read_header_from(fd: int, path: str) -> Header:
    identity = FileIdentity.of(os.fstat(fd))
    size = identity.size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise CheckpointError(
            f"'{path}' is not a safetensors file: {size} bytes, shorter than the 8-byte header length"
        )
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"'{path}': header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + length > size:
        raise CheckpointError(f"'{path}': header length {length} runs past the end of the file ({size} bytes)")
    raw = os.pread(fd, length, 8)
    if len(raw) < length:
        raise CheckpointError(f"'{path}' ended inside its header: the file is truncated")
    return dataclasses.replace(parse_header(path, raw, size), identity=identity)


def parse_header(path: str, raw: bytes, file_size: int) -> Header:
    """Validates the JSON header `raw` of a file of `file_size` bytes; raises CheckpointError naming the problem."""
    try:
        entries = json.loads(raw.decode("utf-8"))
    # ValueError: not UTF-8, not JSON, or an integer too long to convert; RecursionError: nested too deeply.
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"'{path}': the header is not valid JSON ({error})") from None
    if not isinstance(entries, dict):
        raise CheckpointError(f"'{path}': the header must be a JSON object, got {type(entries).__name__}")
    metadata = entries.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):  # keys are str
        raise CheckpointError(f"'{path}': __metadata__ must map strings to strings, got {_shown(metadata)}")
    data_start = 8 + len(raw)
    tensors = {name: _tensor_info(path, name, entry, data_start, file_size) for name, entry in entries.items()}
    _check_layout(path, list(tensors.values()), data_start, file_size)
    return Header(path, metadata, dict(sorted(tensors.items(), key=lambda item: item[1].begin)))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MAX_INT64 = 2**63 - 1


def _shown(value: object, limit: int = 80) -> str:
    """`value` as it appears in an error message, cut short: a header field can be arbitrarily long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tensor_info(path: str, name: str, entry: object, data_start: int, file_size: int) -> TensorInfo:
    where = f"'{path}', tensor '{name}'"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: expected exactly the keys dtype, shape and data_offsets")
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {_shown(dtype_name)} (expected one of {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {_shown(shape)}")
    # torch's sizes and strides are int64: even a tensor of no elements (a 0 in its shape) must fit.
    if math.prod(max(d, 1) for d in shape) > _MAX_INT64:
        raise CheckpointError(
            f"{where}: shape {_shown(shape)} is too large for a tensor (its sizes multiply past 2**63 - 1)"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {_shown(offsets)}"
        )
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(
            f"{where}: shape {_shown(shape)} of {dtype_name} needs {expected} bytes, "
            f"data_offsets {offsets} hold {offsets[1] - offsets[0]}"
        )
    if data_start + offsets[1] > file_size:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} run past the end of the file "
            f"({file_size - data_start} data bytes): the file is truncated"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_layout(path: str, infos: list[TensorInfo], data_start: int, file_size: int) -> None:
    """Every data byte belongs to exactly one tensor: no overlaps, no holes, nothing after the last tensor."""
    position, previous = data_start, None
    for info in sorted(infos, key=lambda info: (info.begin, info.end)):
        if info.begin < position:
            raise CheckpointError(f"'{path}': tensors '{previous}' and '{info.name}' overlap")
        if info.begin > position:
            raise CheckpointError(
                f"'{path}': {info.begin - position} bytes before tensor '{info.name}' belong to no tensor"
            )
        position, previous = info.end, info.name
    if position != file_size:
        raise CheckpointError(f"'{path}': {file_size - position} bytes after the last tensor belong to no tensor")


def read_into(header: Header, targets: Mapping[str, torch.Tensor]) -> None:
    """Reads the named tensors of `header`'s file into `targets` (same shapes), converting dtype and device.

    Targets that are contiguous tensors of the file's dtype, on the CPU (or a GPU, with the native kernels),
    are read into directly; the others through a temporary CPU tensor and `copy_`. The file is opened again by
    its path: when it is no longer the file the header was read from (replaced, truncated, rewritten), this
    raises FileChangedError instead of reading its bytes (`SafetensorsFile` reads through one descriptor).
    """
    fd = os.open(header.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _read_into(header, targets, fd)
    finally:
        os.close(fd)


def _read_into(header: Header, targets: Mapping[str, torch.Tensor], fd: int) -> None:
    direct, converted = [], []
    for name, target in targets.items():
        info = header.tensors[name]
        if tuple(target.shape) != info.shape:
            raise CheckpointError(
                f"'{header.path}', tensor '{name}': the checkpoint has shape {list(info.shape)}, "
                f"the destination {list(target.shape)}"
            )
        if _readable_in_place(target, info.dtype):
            direct.append((info, target))
        else:
            converted.append((info, target, torch.empty(info.shape, dtype=info.dtype)))
    _check_unchanged(fd, header)
    # detach(): the same memory, without autograd objecting to an in-place write into a parameter.
    _read(fd, header.path, [(info, t.detach()) for info, t in direct] + [(info, tmp) for info, _, tmp in converted])
    _check_unchanged(fd, header)  # a writer that changed it during the read
    with torch.no_grad():
        for _, target, temporary in converted:
            target.copy_(temporary)


def _check_unchanged(fd: int, header: Header) -> None:
    if header.identity is None:
        return
    now = FileIdentity.of(os.fstat(fd))
    if now != header.identity:
        raise _changed(header.path, header.identity, now)


def _read(fd: int, path: str, pairs: list[tuple[TensorInfo, torch.Tensor]]) -> None:
    pairs = [(info, tensor) for info, tensor in pairs if info.nbytes]
    if not pairs:
        return
    if _ext.native_for("read_tensors_", "cpu"):
        ops.read_tensors_(fd, path, [info.begin for info, _ in pairs], [t for _, t in pairs])
        return
    for info, tensor in pairs:
        view, done = _bytes_of(tensor), 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.begin + done)
            if n == 0:
                raise CheckpointError(f"'{path}' ended early while reading tensor '{info.name}': the file is truncated")
            done += n


def load_file(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (as `safetensors.torch.load_file`), validated first."""
    with SafetensorsFile(path) as f:
        tensors = {name: torch.empty(info.shape, dtype=info.dtype) for name, info in f.header.tensors.items()}
        f.read_into(tensors)
    return {name: tensor.to(device) for name, tensor in tensors.items()}
