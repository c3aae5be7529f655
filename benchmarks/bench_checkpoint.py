"""Saving and loading model weights through the public API, accel side by side with HF Accelerate, with the disk's
and the memory's limits measured in the same run.

`save_model 251MiB`: `accelerator.save_model(model, folder, max_shard_size="150MB")` of a 251 MiB fp32 model (four
4096x4016 Linear layers: two shards). What is timed is what the training loop waits for, the call itself:
  - `accel`: accel's default mode (the files complete in the page cache on return; fsync, in the background);
  - `accel_async`: `async_save=True` (returns after an in-memory snapshot; written in the background);
  - `accel_durable`: `durable=True` (returns once the files are fsync'd);
  - `hf`: HF Accelerate 1.15's `Accelerator.save_model` (safetensors files, no fsync);
  - limits: `memcpy` (copying the same bytes with plain stores into memory already faulted in: a snapshot's copy
    without the non-temporal stores of accel::stream_copy_, which the asynchronous snapshot uses and which beat it),
    `raw_write` (one sequential write of the bytes to a new file, no fsync: what a page-cache save costs with
    one writer), `raw_write_fsync` (the same, then fsync: the floor of a durable save).
  Each round runs every variant once, in an order rotated by one each round (interleaved); between variants
  (untimed) the background work of accel's save is joined and `os.sync()` empties the dirty page cache, so each
  variant starts from the same state. For accel's modes the time until the checkpoint is durable (call plus
  background work) is recorded too (`*_durable_after_s`).
`load 251MiB`: `load_checkpoint_in_model` (accel; HF's from accelerate.utils) into an existing model, and `raw_read`
  (the files read once into one buffer), from the page cache.

`save_model cuda 2GiB` (issue 25; skipped without a GPU): the same modes and HF's `save_model` of a model whose
  ACCEL_BENCH_GPU_GIB (default 2) GiB of fp32 weights live in GPU memory (one file: the default max_shard_size), with
  the limits `d2h` (the weights copied once into pinned host memory allocated and faulted in before) and
  `raw_write`/`raw_write_fsync` of those bytes; a ratio to HF above 1 is accel faster.

Medians over rounds; a ratio is the median of the per-round ratios. pytest-benchmark's own column is the length of
a whole round; the per-variant samples and medians are in each benchmark's `extra_info`
(`benchmarks/report/checkpoint.py` turns the JSON into docs/benchmarks/checkpoint.md and its plot).

Run:  .venv/bin/pytest benchmarks/bench_checkpoint.py --benchmark-only -p no:cacheprovider -s
      (HF's variants need `pip install accelerate==1.15.0`; without it they are left out, with a notice).
      ACCEL_BENCH_DIR: where the files go (default: build/ in the repository); ACCEL_BENCH_ROUNDS: rounds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import pytest
import torch

from accel.checkpoint import background, load_checkpoint_in_model

LAYERS, IN_FEATURES, OUT_FEATURES = 4, 4096, 4016  # 251 MiB of fp32 weights and biases
SHARD = "150MB"  # two shards
ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "11"))
WARMUP_ROUNDS = 1
CHUNK = 64 << 20


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(IN_FEATURES, OUT_FEATURES) for _ in range(LAYERS)])


def nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.fixture(scope="module")
def workdir():
    root = os.environ.get("ACCEL_BENCH_DIR") or os.path.join(os.path.dirname(__file__), "..", "build")
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=root)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def hf_accelerate():
    try:
        import accelerate
    except ImportError:
        return None
    return accelerate


def interleaved(
    runs: dict[str, Callable[[], dict[str, float]]], rounds: int, first_round: int = 0
) -> dict[str, list[float]]:
    """Every variant once per round, the order rotated by one each round; each run returns {sample name: s}."""
    names = list(runs)
    samples: dict[str, list[float]] = {}
    for r in range(first_round, first_round + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for key, seconds in runs[name]().items():
                samples.setdefault(key, []).append(seconds)
    return samples


def summary(samples: dict[str, list[float]], ratios: tuple) -> dict[str, float]:
    """Median seconds per sample name, and `a/b` ratios as medians of per-round ratios."""
    result = {f"{name}_s": statistics.median(times) for name, times in samples.items()}
    for a, b in ratios:
        if a in samples and b in samples:
            result[f"{a}/{b}"] = statistics.median(x / y for x, y in zip(samples[a], samples[b]))
    return result


def run_rounds(benchmark, group: str, runs: dict, ratios: tuple, **info) -> dict[str, float]:
    interleaved(runs, WARMUP_ROUNDS)  # first-call costs (the snapshot's buffers, thread pools) out of the samples
    samples: dict[str, list[float]] = {}
    rounds_done = [0]

    def one_round() -> None:
        for key, times in interleaved(runs, 1, first_round=rounds_done[0]).items():
            samples.setdefault(key, []).extend(times)
        rounds_done[0] += 1

    benchmark.group = group
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    stats = summary(samples, ratios)
    benchmark.extra_info.update(samples=samples, **stats, **info)
    print(
        f"\n{group}: "
        + ", ".join(f"{k}={v * 1e3:.1f}ms" if k.endswith("_s") else f"{k}={v:.2f}x" for k, v in stats.items())
    )
    return stats


# --- save_model -------------------------------------------------------------------------------------------------


def settle() -> None:
    """Untimed, between variants: accel's background work done, the dirty page cache written out."""
    background.saves.join()
    os.sync()


def timed(
    call: Callable[[], None], name: str, until_durable: bool = False, fresh: str | None = None
) -> dict[str, float]:
    """Times `call` after `settle()` (and, with `fresh`, after removing that file: a new file is what a save
    writes, and truncating an old one costs extra), untimed."""
    if fresh is not None and os.path.exists(fresh):
        os.unlink(fresh)
    settle()
    start = time.perf_counter()
    call()
    waited = time.perf_counter() - start
    result = {name: waited}
    if until_durable:
        background.saves.join()
        result[f"{name}_durable_after"] = time.perf_counter() - start
    return result


def raw_write(path: str, buffer: torch.Tensor, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            done += os.write(fd, view[done : done + CHUNK])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def save_variants(model: torch.nn.Module, folder: str) -> tuple[dict, str | None]:
    from accel.accelerator import Accelerator

    accelerator = Accelerator(cpu=True)
    source = torch.cat([t.reshape(-1) for t in model.state_dict().values()]).view(torch.uint8)
    copy = torch.empty_like(source)
    copy.fill_(0)  # faulted in, as the snapshot's reused buffers are
    out = {name: os.path.join(folder, name) for name in ("accel", "async", "durable", "hf", "raw")}
    runs = {
        "accel": lambda: timed(lambda: accelerator.save_model(model, out["accel"], SHARD), "accel", True),
        "accel_async": lambda: timed(
            lambda: accelerator.save_model(model, out["async"], SHARD, async_save=True), "accel_async", True
        ),
        "accel_durable": lambda: timed(
            lambda: accelerator.save_model(model, out["durable"], SHARD, durable=True), "accel_durable"
        ),
        "memcpy": lambda: timed(lambda: copy.copy_(source), "memcpy"),
        "raw_write": lambda: timed(lambda: raw_write(out["raw"], source, sync=False), "raw_write", fresh=out["raw"]),
        "raw_write_fsync": lambda: timed(
            lambda: raw_write(out["raw"], source, sync=True), "raw_write_fsync", fresh=out["raw"]
        ),
    }
    accelerate = hf_accelerate()
    if accelerate is None:
        return runs, "HF Accelerate is not installed: its variant is left out"
    hf = accelerate.Accelerator(cpu=True)
    runs["hf"] = lambda: timed(lambda: hf.save_model(model, out["hf"], max_shard_size=SHARD), "hf")
    return runs, None


SAVE_RATIOS = (
    ("hf", "accel"),
    ("hf", "accel_async"),
    ("hf", "accel_durable"),
    ("raw_write_fsync", "accel_durable"),
    ("raw_write", "accel"),
    ("memcpy", "accel_async"),
)


def test_save_model(benchmark, workdir):
    model = make_model()
    runs, notice = save_variants(model, workdir)
    try:
        run_rounds(benchmark, "save_model 251MiB", runs, SAVE_RATIOS, bytes=nbytes(model), shards=2, notice=notice)
    finally:
        settle()


# --- load -------------------------------------------------------------------------------------------------------


def test_load_checkpoint_in_model(benchmark, workdir):
    from accel.checkpoint import save_state_dict

    model = make_model()
    folder = os.path.join(workdir, "load")
    save_state_dict(model.state_dict(), folder, max_shard_size=SHARD, progress=False)
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    buffer = torch.empty(sum(os.path.getsize(f) for f in files), dtype=torch.uint8)
    buffer.fill_(0)

    def read_all() -> None:
        view, done = memoryview(buffer.numpy()), 0
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while (n := f.readinto(view[done : done + CHUNK])) > 0:
                    done += n

    def measure(call, name):
        start = time.perf_counter()
        call()
        return {name: time.perf_counter() - start}

    runs = {
        "accel": lambda: measure(lambda: load_checkpoint_in_model(model, folder, strict=True, progress=False), "accel"),
        "raw_read": lambda: measure(read_all, "raw_read"),
    }
    notice = "HF Accelerate is not installed: its variant is left out"
    if hf_accelerate() is not None:
        from accelerate.utils import load_checkpoint_in_model as hf_load

        runs["hf"] = lambda: measure(lambda: hf_load(model, folder, strict=True), "hf")
        notice = None
    run_rounds(
        benchmark, "load 251MiB", runs, (("hf", "accel"), ("raw_read", "accel")), bytes=nbytes(model), notice=notice
    )


# --- from GPU memory (issue 25) ---------------------------------------------------------------------------------

GPU_GIB = float(os.environ.get("ACCEL_BENCH_GPU_GIB", "2"))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_gpu_model(gib: float = GPU_GIB) -> torch.nn.Module:
    """fp32 Linear layers of 4096x4096 (64 MiB each, no bias), `gib` GiB in all, built in GPU memory."""
    torch.manual_seed(0)
    layers = max(1, round(gib * 16))
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False, device="cuda") for _ in range(layers)])


def device_to_host(model: torch.nn.Module, host: torch.Tensor) -> None:
    """Every weight copied once into `host` (pinned, one buffer): what any save must move off the GPU."""
    offset = 0
    for tensor in model.state_dict().values():
        n = tensor.numel() * tensor.element_size()
        host[offset : offset + n].copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)
        offset += n
    torch.cuda.synchronize()


def gpu_save_variants(model: torch.nn.Module, folder: str) -> tuple[dict, str | None]:
    from accel.accelerator import Accelerator
    from accel.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # after the CPU cases' Accelerator(cpu=True)
    GradientState._reset_state()
    accelerator = Accelerator()
    assert accelerator.device.type == "cuda"
    host = torch.empty(nbytes(model), dtype=torch.uint8, pin_memory=True)
    host.fill_(0)  # faulted in
    out = {name: os.path.join(folder, f"gpu-{name}") for name in ("accel", "async", "durable", "hf", "raw")}

    def synced(call):
        def run():
            torch.cuda.synchronize()  # the model's weights are ready, as after an optimizer step
            call()

        return run

    runs = {
        "accel": lambda: timed(synced(lambda: accelerator.save_model(model, out["accel"])), "accel", True),
        "accel_async": lambda: timed(
            synced(lambda: accelerator.save_model(model, out["async"], async_save=True)), "accel_async", True
        ),
        "accel_durable": lambda: timed(
            synced(lambda: accelerator.save_model(model, out["durable"], durable=True)), "accel_durable"
        ),
        "d2h": lambda: timed(synced(lambda: device_to_host(model, host)), "d2h"),
        "raw_write": lambda: timed(lambda: raw_write(out["raw"], host, sync=False), "raw_write", fresh=out["raw"]),
        "raw_write_fsync": lambda: timed(
            lambda: raw_write(out["raw"], host, sync=True), "raw_write_fsync", fresh=out["raw"]
        ),
    }
    accelerate = hf_accelerate()
    if accelerate is None:
        return runs, "HF Accelerate is not installed: its variant is left out"
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    hf = accelerate.Accelerator()
    assert hf.device.type == "cuda"
    runs["hf"] = lambda: timed(synced(lambda: hf.save_model(model, out["hf"])), "hf")
    return runs, None


GPU_SAVE_RATIOS = (
    ("hf", "accel"),
    ("hf", "accel_async"),
    ("hf", "accel_durable"),
    ("d2h", "accel"),
    ("raw_write", "accel"),
    ("raw_write_fsync", "accel_durable"),
    ("d2h", "accel_async"),
)


@needs_cuda
def test_save_model_from_gpu(benchmark, workdir):
    model = make_gpu_model()
    runs, notice = gpu_save_variants(model, workdir)
    try:
        run_rounds(
            benchmark,
            f"save_model cuda {GPU_GIB:g}GiB",
            runs,
            GPU_SAVE_RATIOS,
            bytes=nbytes(model),
            shards=1,
            device="cuda",
            gpu=torch.cuda.get_device_name(),
            filesystem=workdir,
            notice=notice,
        )
    finally:
        settle()
