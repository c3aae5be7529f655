"""load_checkpoint_and_dispatch on the CPU through the public API: accel side by side with HF Accelerate, with the
limit measured in the same run.

Each case loads a checkpoint of fp32 Linear layers (written once per session) into a model built under
`init_empty_weights`, with `device_map={"": "cpu"}`:
  - `251MiB`: four 4096x4016 layers with biases, max_shard_size 150MB (two shards), as issue 13's row;
  - `1GiB`: sixteen 4096x4096 layers without biases, 256MB shards.
Variants, one of each per round in a rotated order (interleaved), the previous model freed (untimed) before each:
  - `accel`: accel's default, the weights served zero-copy from the page cache through a read-leased private
    mapping (accel.checkpoint.leased_mapping: a writer that rewrites the file in place gets the weights copied
    first, so they never change underneath);
  - `accel_copy`: `ACCEL_MAP_CHECKPOINTS=0`, the weights read into fresh memory (what a copying loader costs);
  - `hf`: HF Accelerate 1.15's `load_checkpoint_and_dispatch` (left out, with a notice, when not installed);
  - `read_limit`: the shard files read once into one buffer already faulted in (the floor of any copying loader).
Medians over rounds; ratios are medians of per-round ratios. The peak memory of one load is measured in a fresh
process per loader (`peak_rss_growth_*` in extra_info: RSS peak minus RSS before the load).

To GPU memory (`test_load_checkpoint_and_dispatch_to_gpu`, issue 25; skipped without a GPU): a checkpoint of
ACCEL_BENCH_GPU_GIB (default 2) GiB of fp32 4096x4096 layers (one file) loaded with `device_map={"": 0}`:
  - `accel`, `hf`: `load_checkpoint_and_dispatch` into a model built under `init_empty_weights`;
  - `accel_in_place`, `hf_in_place`: `load_checkpoint_in_model` into a model already on the GPU (accel's native
    reader streams the file into GPU memory through pinned buffers: the op-level column);
  - limits: `read_limit` (the file read once into host memory already faulted in) and `h2d` (those bytes, pinned,
    copied once into GPU memory allocated before).

Run: .venv/bin/pytest benchmarks/bench_big_model.py --benchmark-only -p no:cacheprovider -s
(`make bench-big-model` also writes docs/benchmarks/big_model.md through benchmarks/report/big_model.py.)
ACCEL_BENCH_ROUNDS: rounds (default 7).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

CASES = {  # name: (layers, in features, out features, bias, max_shard_size)
    "251MiB": (4, 4096, 4016, True, "150MB"),
    "1GiB": (16, 4096, 4096, False, "256MB"),
}
ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "7"))
CHUNK = 64 << 20


def make_model(case: str) -> torch.nn.Module:
    layers, fan_in, fan_out, bias, _ = CASES[case]
    return torch.nn.Sequential(*[torch.nn.Linear(fan_in, fan_out, bias=bias) for _ in range(layers)])


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request):
    from accel.checkpoint import save_state_dict

    root = os.environ.get("ACCEL_BENCH_DIR") or os.path.join(os.path.dirname(__file__), "..", "build")
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-big-model-", dir=root)
    save_state_dict(
        make_model(request.param).state_dict(), folder, max_shard_size=CASES[request.param][4], progress=False
    )
    yield request.param, folder
    shutil.rmtree(folder, ignore_errors=True)


def load_with(library: str, case: str, folder: str) -> torch.nn.Module:
    if library == "hf":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    else:
        from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    with init_empty_weights():
        model = make_model(case)
    return load_checkpoint_and_dispatch(model, folder, device_map={"": "cpu"})


# VmHWM, not getrusage's ru_maxrss: a child started by vfork + exec inherits its parent's peak in ru_maxrss.
PEAK = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {here!r})
    from bench_big_model import load_with
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    before = status("VmRSS")
    load_with({library!r}, {case!r}, {folder!r})
    print(json.dumps(status("VmHWM") - before))
    """
)


def peak_growth(library: str, case: str, folder: str) -> int:
    script = PEAK.format(
        here=os.path.dirname(os.path.abspath(__file__)), library=library.removesuffix("_copy"), case=case, folder=folder
    )
    env = dict(os.environ, ACCEL_MAP_CHECKPOINTS="0" if library == "accel_copy" else "1")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True, env=env
    )
    return int(result.stdout.strip().splitlines()[-1])


class Loads:
    """The variants; each call frees the model the previous one loaded (untimed), then times one load."""

    def __init__(self, case: str, folder: str) -> None:
        self.case, self.folder, self.loaded = case, folder, None
        self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        self.buffer = torch.empty(sum(os.path.getsize(f) for f in self.files), dtype=torch.uint8)
        self.buffer.fill_(0)  # faulted in: the floor of reading, without the cost of fresh memory

    def timed(self, load) -> float:
        self.loaded = None
        gc.collect()
        start = time.perf_counter()
        self.loaded = load()
        return time.perf_counter() - start

    def accel(self) -> float:
        return self.timed(lambda: load_with("accel", self.case, self.folder))

    def accel_copy(self) -> float:
        os.environ["ACCEL_MAP_CHECKPOINTS"] = "0"
        try:
            return self.timed(lambda: load_with("accel", self.case, self.folder))
        finally:
            del os.environ["ACCEL_MAP_CHECKPOINTS"]

    def hf(self) -> float:
        return self.timed(lambda: load_with("hf", self.case, self.folder))

    def read_limit(self) -> float:
        def read_all():
            view, done = memoryview(self.buffer.numpy()), 0
            for path in self.files:
                with open(path, "rb", buffering=0) as f:
                    while (n := f.readinto(view[done : done + CHUNK])) > 0:
                        done += n

        return self.timed(read_all)


def test_load_checkpoint_and_dispatch(benchmark, checkpoint):
    case, folder = checkpoint
    loads = Loads(case, folder)
    names = ["accel", "accel_copy", "read_limit"]
    notice = None
    try:
        import accelerate  # noqa: F401

        names.append("hf")
    except ImportError:
        notice = "HF Accelerate is not installed: its variant is left out"
    samples = {name: [] for name in names}
    for name in names:  # warm-up: imports, thread pools, the page cache
        getattr(loads, name)()
    rounds = [0]

    def one_round() -> None:
        shift = rounds[0] % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(getattr(loads, name)())
        rounds[0] += 1

    benchmark.group = f"load_checkpoint_and_dispatch {case}"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    loads.loaded = None
    stats = {f"{name}_s": statistics.median(times) for name, times in samples.items()}
    for other in ("hf", "accel_copy", "read_limit"):
        if other in samples:
            stats[f"{other}/accel"] = statistics.median(o / a for o, a in zip(samples[other], samples["accel"]))
    if "hf" in samples:
        stats["hf/accel_copy"] = statistics.median(h / c for h, c in zip(samples["hf"], samples["accel_copy"]))
    peaks = {f"peak_rss_growth_{name}": peak_growth(name, case, folder) for name in names if name != "read_limit"}
    benchmark.extra_info.update(case=case, bytes=loads.buffer.numel(), samples=samples, notice=notice, **stats, **peaks)
    print(
        f"\n{case}: "
        + ", ".join(f"{k}={v * 1e3:.1f}ms" if k.endswith("_s") else f"{k}={v:.2f}x" for k, v in stats.items())
    )


# --- to GPU memory (issue 25) -----------------------------------------------------------------------------------

GPU_GIB = float(os.environ.get("ACCEL_BENCH_GPU_GIB", "2"))
GPU_ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "5"))


def make_gpu_model(device: str = "cuda") -> torch.nn.Module:
    layers = max(1, round(GPU_GIB * 16))  # 64 MiB each
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False, device=device) for _ in range(layers)])


def load_to_gpu(library: str, folder: str) -> torch.nn.Module:
    if library == "hf":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    else:
        from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    with init_empty_weights():
        model = make_gpu_model("cpu")
    model = load_checkpoint_and_dispatch(model, folder, device_map={"": 0})
    torch.cuda.synchronize()
    return model


def load_in_place(library: str, model: torch.nn.Module, folder: str) -> None:
    if library == "hf":
        from accelerate.utils import load_checkpoint_in_model
    else:
        from accel.checkpoint import load_checkpoint_in_model
    load_checkpoint_in_model(model, folder, strict=True)
    torch.cuda.synchronize()


class GpuLoads:
    """The variants; each frees what the previous one loaded (untimed), then times one load."""

    def __init__(self, folder: str, expected: dict[str, torch.Tensor]) -> None:
        self.folder, self.expected, self.loaded = folder, expected, None
        self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(f) for f in self.files)
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.host.fill_(0)
        self.device_buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
        self.target = make_gpu_model()  # the in-place loads' destination

    def timed(self, load) -> float:
        self.loaded = None
        gc.collect()
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.loaded = load()
        return time.perf_counter() - start

    def check(self, model: torch.nn.Module) -> None:
        """The loaded weights are the checkpoint's, bit for bit (untimed, once per variant)."""
        state = model.state_dict()
        assert all(state[n].is_cuda and torch.equal(state[n], t) for n, t in self.expected.items())

    def accel(self) -> float:
        return self.timed(lambda: load_to_gpu("accel", self.folder))

    def hf(self) -> float:
        return self.timed(lambda: load_to_gpu("hf", self.folder))

    def accel_in_place(self) -> float:
        return self.timed(lambda: load_in_place("accel", self.target, self.folder) or self.target)

    def hf_in_place(self) -> float:
        return self.timed(lambda: load_in_place("hf", self.target, self.folder) or self.target)

    def read_limit(self) -> float:
        def read_all():
            view, done = memoryview(self.host.numpy()), 0
            for path in self.files:
                with open(path, "rb", buffering=0) as f:
                    while (n := f.readinto(view[done : done + CHUNK])) > 0:
                        done += n

        return self.timed(read_all)

    def h2d(self) -> float:
        def copy():
            self.device_buffer.copy_(self.host, non_blocking=True)
            torch.cuda.synchronize()

        return self.timed(copy)


@pytest.fixture(scope="module")
def gpu_checkpoint():
    from accel.checkpoint import save_state_dict

    root = os.environ.get("ACCEL_BENCH_DIR") or os.path.join(os.path.dirname(__file__), "..", "build")
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-big-model-gpu-", dir=root)
    torch.manual_seed(0)
    state = make_gpu_model().state_dict()
    save_state_dict(state, folder, progress=False, durable=False)
    yield folder, state
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_checkpoint_and_dispatch_to_gpu(benchmark, gpu_checkpoint):
    folder, expected = gpu_checkpoint
    loads = GpuLoads(folder, expected)
    names = ["accel", "accel_in_place", "read_limit", "h2d"]
    notice = None
    try:
        import accelerate  # noqa: F401

        names += ["hf", "hf_in_place"]
    except ImportError:
        notice = "HF Accelerate is not installed: its variants are left out"
    samples = {name: [] for name in names}
    for name in names:  # warm-up (imports, pinned buffers, the page cache), and each result checked once
        getattr(loads, name)()
        if name not in ("read_limit", "h2d"):
            loads.check(loads.loaded)
    rounds = [0]

    def one_round() -> None:
        shift = rounds[0] % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(getattr(loads, name)())
        rounds[0] += 1

    benchmark.group = f"load_checkpoint_and_dispatch cuda {GPU_GIB:g}GiB"
    benchmark.pedantic(one_round, rounds=GPU_ROUNDS, iterations=1)
    loads.loaded = None
    stats = {f"{name}_s": statistics.median(times) for name, times in samples.items()}
    for slower, faster in (
        ("hf", "accel"),
        ("hf_in_place", "accel_in_place"),
        ("read_limit", "accel"),
        ("h2d", "accel"),
        ("accel", "accel_in_place"),
    ):
        if slower in samples and faster in samples:
            stats[f"{slower}/{faster}"] = statistics.median(a / b for a, b in zip(samples[slower], samples[faster]))
    benchmark.extra_info.update(
        case=f"cuda {GPU_GIB:g}GiB",
        device="cuda",
        gpu=torch.cuda.get_device_name(),
        bytes=loads.host.numel(),
        samples=samples,
        notice=notice,
        **stats,
    )
    print(
        f"\ncuda {GPU_GIB:g}GiB: "
        + ", ".join(f"{k}={v * 1e3:.1f}ms" if k.endswith("_s") else f"{k}={v:.2f}x" for k, v in stats.items())
    )
