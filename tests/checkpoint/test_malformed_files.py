"""Malformed safetensors files (issue 19, defect 9): every reader either loads a file exactly as its bytes say or
raises CheckpointError naming the file, never another exception.

A seeded fuzz mutates one small valid file (the header's JSON values, its bytes, the length prefix, truncation,
bit flips, appended bytes, JSON oddities) into a few hundred mutants; each is read by every reader: `load_file`
(one descriptor, the native or the fallback read path), big_modeling's `load_state_dict` (header first, data by
path), `load_checkpoint_in_model` and `load_checkpoint_and_dispatch` (the leased mapping). What a reader accepts is
checked against a plain decoding of the mutant's bytes. A failure prints the mutant (ACCEL_FUZZ_SEED replays
another seed).
"""

import json
import os
import random
import struct

import pytest
import torch

from accel.big_modeling import load_checkpoint_and_dispatch, load_state_dict
from accel.checkpoint import load_checkpoint_in_model, load_file, save_file
from accel.checkpoint import safetensors_io as io
from accel.checkpoint.safetensors_io import CheckpointError

SEED = int(os.environ.get("ACCEL_FUZZ_SEED", "19"))
MUTANTS = 450


def original_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(2, 3, generator=generator),
        "ids": torch.arange(4, dtype=torch.int64),
        "bf": torch.randn(2, 2, generator=generator).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 2, dtype=torch.float16),
        "scalar": torch.tensor(1.5),
    }


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("original") / "model.safetensors"
    save_file(original_tensors(), path, metadata={"source": "fuzz"})  # no "format": load_state_dict checks it as HF
    return path.read_bytes()


# --- mutations: each takes a seeded generator, its turn (so that every listed bad value comes up) and the valid
# file; returns (what it did, the mutant's bytes) -----------------------------------------------------------------

BAD_VALUES = {
    "dtype": [["F32"], {"F32": 1}, 3, None, True, 1.5, "F33", "f32", "", "I64", "BOOL", "U8", "BF16", "F64"],
    "shape": [
        [2.0, 3],
        "2,3",
        None,
        {"0": 2},
        [[2], 3],
        [-1],
        [True, 3],
        [2**63],
        [0, 2**63],
        [0, 2**62, 4],
        [0, 2**64],
        [3, 2],
        [6],
        [],
        [1e30],
        [2, 3, 1],
        [1] * 200,
    ],
    "data_offsets": [
        [0],
        [0, 1, 2],
        [8, 0],
        [0.0, 24],
        ["0", "24"],
        None,
        {"begin": 0},
        [-8, 16],
        [0, 2**64],
        [[0], [24]],
        [True, 24],
        [2**70, 2**70 + 24],
    ],
}
BAD_ENTRIES = [[], 1, None, "x", {"dtype": "F32"}, {"dtype": "F32", "shape": [], "data_offsets": [0, 4], "x": 1}]
BAD_METADATA = [[], 1, "pt", {"k": 1}, {"k": ["v"]}, {"k": None}, None, {}, {"": ""}, [["k", "v"]]]


def split(blob: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def join(header: object, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


# Shapes for the tensor of no bytes: only there do sizes like [0, 2**63] pass the byte count.
EMPTY_SHAPES = [[0, 2**63], [0, 2**62, 4], [0, 2**64], [0, 2**61, 4], [0, 2**60, 4], [0, 0, 2**63 - 1], [0, -1]]
FIELD_VALUES = [(None, field, value) for field, values in BAD_VALUES.items() for value in values] + [
    ("empty", "shape", shape) for shape in EMPTY_SHAPES
]


def mutate_a_field(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    header, data = split(blob)
    name, field, value = FIELD_VALUES[turn % len(FIELD_VALUES)]
    name = name or rng.choice([n for n in header if n != "__metadata__"])
    header[name][field] = value
    return f"{name}.{field} = {value!r}"[:120], join(header, data)


def mutate_offsets(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    header, data = split(blob)
    names = [n for n in header if n != "__metadata__"]
    a, b = rng.sample(names, 2)
    how = rng.choice(["swap", "shift", "copy", "grow"])
    if how == "swap":
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    elif how == "copy":
        header[a]["data_offsets"] = list(header[b]["data_offsets"])
    else:
        delta = rng.choice([-8, -4, -2, -1, 1, 2, 4, 8])
        header[a]["data_offsets"] = [
            o + (delta if how == "shift" or i == 1 else 0) for i, o in enumerate(header[a]["data_offsets"])
        ]
    return f"{how} data_offsets of {a} ({b})", join(header, data)


def mutate_an_entry(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    header, data = split(blob)
    name = rng.choice([n for n in header if n != "__metadata__"])
    choice = turn % (len(BAD_METADATA) + len(BAD_ENTRIES) + 1)
    if choice < len(BAD_METADATA):
        header["__metadata__"] = BAD_METADATA[choice]
        return f"__metadata__ = {BAD_METADATA[choice]!r}", join(header, data)
    if choice < len(BAD_METADATA) + len(BAD_ENTRIES):
        header[name] = BAD_ENTRIES[choice - len(BAD_METADATA)]
        return f"{name} = {header[name]!r}", join(header, data)
    header[name + "x"] = header.pop(name)
    return f"rename {name}", join(header, data)


def mutate_the_length(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    (length,) = struct.unpack("<Q", blob[:8])
    value = rng.choice(
        [
            0,
            1,
            2,
            7,
            length - 1,
            length + 1,
            length + 8,
            len(blob) - 8,
            len(blob),
            2**63,
            2**64 - 1,
            io.MAX_HEADER_BYTES + 1,
            rng.randrange(2**64),
            rng.randrange(length + 64),
        ]
    )
    return f"length prefix {value}", struct.pack("<Q", value) + blob[8:]


def truncate(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    end = rng.randrange(len(blob))
    return f"truncated to {end} bytes", blob[:end]


def flip_bits(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    mutant = bytearray(blob)
    (length,) = struct.unpack("<Q", blob[:8])
    start, end = (0, 8 + length) if turn % 2 else (8 + length, len(blob))  # the header, or the data (read as is)
    positions = [rng.randrange(start, end) for _ in range(rng.randint(1, 4))]
    bits = [rng.randrange(8) for _ in positions]
    for position, bit in zip(positions, bits):
        mutant[position] ^= 1 << bit
    return f"bits flipped at {list(zip(positions, bits))}", bytes(mutant)


def overwrite_header_bytes(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    mutant = bytearray(blob)
    (length,) = struct.unpack("<Q", blob[:8])
    changes = [(8 + rng.randrange(length), rng.choice([rng.randrange(256), *b'"[]{},:0-9 \\e.'])) for _ in range(3)]
    for position, value in changes[: rng.randint(1, 3)]:
        mutant[position] = value
    return f"header bytes set {changes}", bytes(mutant)


def append_bytes(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return f"{len(extra)} bytes appended", blob + extra


def json_oddity(rng: random.Random, turn: int, blob: bytes) -> tuple[str, bytes]:
    header, data = split(blob)
    oddities = {
        "deep nesting": b"[" * 100_000,
        "an integer of 5000 digits": json.dumps(header).replace("[2, 3]", "[" + "9" * 5000 + ", 3]").encode(),
        "NaN offsets": json.dumps(header).replace('"data_offsets": [0, 24]', '"data_offsets": [NaN, 24]').encode(),
        "Infinity in a shape": json.dumps(header).replace("[2, 3]", "[Infinity, 3]").encode(),
        "a list": b"[1, 2]",
        "a string": b'"model"',
        "null": b"null",
        "invalid UTF-8": json.dumps(header).encode().replace(b"source", b"sou\xffce"),
        "a byte-order mark": b"\xef\xbb\xbf" + json.dumps(header).encode(),
        "a duplicated key": json.dumps(header).replace('"w":', '"ids": {}, "w":').encode(),
    }
    what = sorted(oddities)[turn % len(oddities)]
    text = oddities[what]
    return what, struct.pack("<Q", len(text)) + text + data


MUTATIONS = [
    mutate_a_field,
    mutate_offsets,
    mutate_an_entry,
    mutate_the_length,
    truncate,
    flip_bits,
    overwrite_header_bytes,
    append_bytes,
    json_oddity,
]


def mutants(blob: bytes) -> list[tuple[str, bytes]]:
    made = []
    for i in range(MUTANTS):
        mutation = MUTATIONS[i % len(MUTATIONS)]
        what, mutant = mutation(random.Random(SEED * 1_000_003 + i), i // len(MUTATIONS), blob)
        made.append((f"#{i} {mutation.__name__}: {what}", mutant))
    return made


# --- what the bytes say, decoded plainly ---------------------------------------------------------------------------


def decoded(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors as the mutant's header places them (used once a reader has accepted the file)."""
    header, _ = split(blob)
    start = 8 + struct.unpack("<Q", blob[:8])[0]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(blob[start + begin : start + end]) or bytearray(1), dtype=torch.uint8)
        tensors[name] = raw[: end - begin].view(io.DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


# --- the readers: each returns a complaint, or None when it loaded the mutant as its bytes say ----------------------


def check_file_reader(read, path: str, blob: bytes) -> str | None:
    loaded, expected = read(path), decoded(blob)
    if sorted(loaded) != sorted(expected):
        return f"loaded {sorted(loaded)}, the bytes hold {sorted(expected)}"
    wrong = [name for name in expected if not identical(loaded[name], expected[name])]
    return f"tensors {wrong} differ from the file's bytes" if wrong else None


class Holder(torch.nn.Module):
    """A model with a buffer per original tensor (any dtype), filled with a marker value."""

    def __init__(self):
        super().__init__()
        for name, tensor in original_tensors().items():
            self.register_buffer(name, torch.full_like(tensor, 3))


def check_model_reader(load, path: str, blob: bytes) -> str | None:
    model = Holder()
    load(model, path)
    expected, untouched = decoded(blob), Holder()
    for name, buffer in model.named_buffers():
        if name in expected and expected[name].shape != buffer.shape:
            return f"'{name}' was loaded although its shape {list(expected[name].shape)} is not the model's"
        want = expected[name].to(buffer.dtype) if name in expected else getattr(untouched, name)
        if not same_values(buffer.cpu(), want):
            return f"'{name}' holds {buffer.tolist()}, the file's bytes say {want.tolist()}"
    return None


READERS = {
    "load_file": lambda path, blob: check_file_reader(load_file, path, blob),
    "load_state_dict": lambda path, blob: check_file_reader(load_state_dict, path, blob),
    "load_checkpoint_in_model": lambda path, blob: check_model_reader(load_checkpoint_in_model, path, blob),
    "load_checkpoint_and_dispatch": lambda path, blob: check_model_reader(load_checkpoint_and_dispatch, path, blob),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_every_malformed_file_loads_as_its_bytes_say_or_raises_checkpoint_error(tmp_path, original, reader):
    check = READERS[reader]
    failures, refused = [], 0
    for i, (what, blob) in enumerate(mutants(original)):
        path = tmp_path / f"{i}.safetensors"
        path.write_bytes(blob)
        try:
            complaint = check(str(path), blob)
        except CheckpointError as error:
            refused += 1
            complaint = None if str(path) in str(error) else f"CheckpointError without the file's name: {error}"
        except Exception as error:  # noqa: BLE001 - anything but CheckpointError is the failure looked for
            complaint = f"{type(error).__name__}: {error}"[:300]
        if complaint is not None:
            failures.append(f"{what}\n    {complaint}\n    header: {blob[:160]!r}")
        path.unlink()
    assert not failures, f"seed {SEED}, {len(failures)} of {MUTANTS} mutants:\n" + "\n".join(failures)
    assert MUTANTS // 2 < refused < MUTANTS  # the mutants reach both outcomes
