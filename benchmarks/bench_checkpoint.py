"""Saving and loading model weights: accel's native writer/reader against HF Accelerate, torch.save/load, and the
disk itself.

Groups: `save 256MiB`, `save 1GiB`, `load 256MiB`, `load 1GiB` (fp32 state dicts of 64 MiB tensors plus small
ones, as a model has them; max_shard_size 512MB, so the 1 GiB one is sharded). Benchmarks in a group:
  - `accel`: `accel.checkpoint.save_state_dict` / `load_checkpoint_in_model`;
  - `hf_accelerate`: HF Accelerate's `Accelerator.save_model` / `accelerate.utils.load_checkpoint_in_model`
    (skipped when accelerate is not installed);
  - `torch`: `torch.save` of the whole state dict / `torch.load(weights_only=True)` + `load_state_dict`;
  - `limit`: one sequential write (then fsync) of the same number of bytes from one buffer / one sequential read.
Before every timed save the page cache is flushed with `sync` (not timed). A save counts as done when its bytes
are on disk: accel's and the limit's fsync their files; HF's and torch's do not, so their timings include an
`os.sync()` after the save (without it they would be measured writing into the page cache). Loads read files
that were just written, i.e. mostly from the page cache, for every contender alike.

Run: .venv/bin/pytest benchmarks/bench_checkpoint.py --benchmark-only -p no:cacheprovider
(`make bench-checkpoint` also writes docs/benchmarks/checkpoint.md and its plot.)
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from accel.checkpoint import load_checkpoint_in_model, save_state_dict

SIZES = {"256MiB": 256 << 20, "1GiB": 1 << 30}
SHARD = "512MB"
ROUNDS = {"256MiB": 9, "1GiB": 5}


def make_model(nbytes: int) -> torch.nn.Module:
    """Linear layers of 64 MiB weights with small biases, `nbytes` in all."""
    layers = max(1, nbytes // (64 << 20))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.fixture(scope="module")
def workdir():
    root = os.environ.get("ACCEL_BENCH_DIR") or os.path.join(os.path.dirname(__file__), "..", "build")
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=root)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


_models: dict[str, torch.nn.Module] = {}


@pytest.fixture(params=list(SIZES))
def case(request, workdir):
    name = request.param
    if name not in _models:
        _models.clear()
        _models[name] = make_model(SIZES[name])
    return name, _models[name], workdir


def nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def timed_save(benchmark, case, kind, save):
    name, model, workdir = case
    benchmark.group = f"save {name}"
    benchmark.extra_info["bytes"] = nbytes(model)
    target = os.path.join(workdir, f"{kind}-{name}")

    def setup():
        shutil.rmtree(target, ignore_errors=True)
        os.sync()

    benchmark.pedantic(lambda: save(model, target), setup=setup, rounds=ROUNDS[name], warmup_rounds=0)


def timed_load(benchmark, case, kind, save, load):
    name, model, workdir = case
    benchmark.group = f"load {name}"
    benchmark.extra_info["bytes"] = nbytes(model)
    target = os.path.join(workdir, f"{kind}-{name}-load")
    shutil.rmtree(target, ignore_errors=True)
    save(model, target)
    # Every contender loads into the same module's existing tensors: allocation is not what is measured.
    benchmark.pedantic(lambda: load(model, target), rounds=ROUNDS[name], warmup_rounds=1)
    shutil.rmtree(target, ignore_errors=True)


def accel_save(model, target):
    save_state_dict(model.state_dict(), target, max_shard_size=SHARD, progress=False)


def accel_load(model, target):
    load_checkpoint_in_model(model, target, strict=True, progress=False)


def hf_save(model, target):
    accelerate = pytest.importorskip("accelerate")
    accelerate.Accelerator(cpu=True).save_model(model, target, max_shard_size=SHARD)
    os.sync()  # durable, like the others


def hf_load(model, target):
    from accelerate.utils import load_checkpoint_in_model as hf_load_checkpoint_in_model

    hf_load_checkpoint_in_model(model, target, strict=True)


def torch_save(model, target):
    os.makedirs(target, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(target, "pytorch_model.bin"))
    os.sync()  # durable, like the others


def torch_load(model, target):
    model.load_state_dict(torch.load(os.path.join(target, "pytorch_model.bin"), weights_only=True))


def limit_save(model, target):
    """The same number of bytes written sequentially from one buffer, then fsync'd: what the disk allows."""
    os.makedirs(target, exist_ok=True)
    buffer = _buffer(nbytes(model))
    fd = os.open(os.path.join(target, "raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            done += os.write(fd, view[done : done + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)


def limit_load(model, target):
    buffer = _buffer(nbytes(model))
    with open(os.path.join(target, "raw"), "rb", buffering=0) as f:
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            done += f.readinto(view[done : done + (64 << 20)])


_buffers: dict[int, torch.Tensor] = {}


def _buffer(size: int) -> torch.Tensor:
    if size not in _buffers:
        _buffers.clear()
        _buffers[size] = torch.ones(size, dtype=torch.uint8)
    return _buffers[size]


def test_save_accel(benchmark, case):
    timed_save(benchmark, case, "accel", accel_save)


def test_save_hf_accelerate(benchmark, case):
    pytest.importorskip("accelerate")
    timed_save(benchmark, case, "hf", hf_save)


def test_save_torch(benchmark, case):
    timed_save(benchmark, case, "torch", torch_save)


def test_save_limit(benchmark, case):
    timed_save(benchmark, case, "limit", limit_save)


def test_load_accel(benchmark, case):
    timed_load(benchmark, case, "accel", accel_save, accel_load)


def test_load_hf_accelerate(benchmark, case):
    pytest.importorskip("accelerate")
    timed_load(benchmark, case, "hf", hf_save, hf_load)


def test_load_torch(benchmark, case):
    timed_load(benchmark, case, "torch", torch_save, torch_load)


def test_load_limit(benchmark, case):
    timed_load(benchmark, case, "limit", limit_save, limit_load)
