"""accel::stream_copy_ (the staging copy of an asynchronous sharded save: accel/checkpoint/shard_stager.py) against
its reference `torch._foreach_copy_` and the per-tensor `copy_` loop the FSDP2 benchmark calls a memcpy.

This is the op-level column; the headline is the public path, `save_state(async_save=True)` under FSDP2 against a
memcpy of the rank's shards (bench_fsdp2.py, docs/benchmarks/fsdp2.md). Each case is one rank's shards of a 4-layer
GPT-2 (parameters and AdamW's two states, halved as on 2 ranks); before each round a 64 MiB buffer is written, as
a training step would, so the copy starts from the caches it would find (the sources and targets not cached).
One thread, as each of the benchmark's ranks runs.

Run: .venv/bin/pytest benchmarks/bench_stream_copy.py --benchmark-only -p no:cacheprovider
"""

import pytest
import torch

from accel import _ext

WIDTHS = {"gpt2-w256 (19.6 MiB)": 256, "gpt2-w768 (167 MiB)": 768}
VOCAB, POSITIONS, LAYERS = 1024, 1024, 4


def gpt2_shapes(width: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a 4-layer GPT-2 (tied output layer): embeddings, then per block two layer norms,
    the attention's and the MLP's weights and biases, then the final layer norm."""
    block = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,)]
    block += [(width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [(VOCAB, width), (POSITIONS, width), *block * LAYERS, (width,), (width,)]


def rank_shards(width: int) -> list[torch.Tensor]:
    """One of 2 ranks' shards (dim 0 halved) of every parameter and of AdamW's exp_avg and exp_avg_sq."""
    halves = [(max(1, shape[0] // 2), *shape[1:]) for shape in gpt2_shapes(width)]
    return [torch.randn(shape) for shape in halves * 3]


@pytest.fixture(params=list(WIDTHS), ids=list(WIDTHS))
def pairs(request):
    sources = rank_shards(WIDTHS[request.param])
    targets = [torch.zeros_like(source) for source in sources]  # faulted in, as the kept copy is
    return request.param, targets, sources


def run(benchmark, pairs, copy):
    name, targets, sources = pairs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    evict = torch.empty(16 << 20)  # 64 MiB: more than this machine's last-level cache
    benchmark.group = f"staging copy {name}"

    def setup():
        evict.fill_(1.0)
        return (targets, sources), {}

    try:
        benchmark.pedantic(copy, setup=setup, rounds=60, iterations=1)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(target, source) for target, source in zip(targets, sources))


@pytest.mark.skipif(not _ext.status().loaded, reason="native extension not loaded")
def test_native(benchmark, pairs):
    run(benchmark, pairs, torch.ops.accel.stream_copy_.default)


def test_reference(benchmark, pairs):
    run(benchmark, pairs, torch._foreach_copy_)


def copy_loop(targets, sources):
    for target, source in zip(targets, sources):
        target.copy_(source)


def test_memcpy_loop(benchmark, pairs):
    run(benchmark, pairs, copy_loop)
