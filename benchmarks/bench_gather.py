"""The padded all-gather: accel's shared-memory transport against its torch.distributed reference and HF Accelerate.

Runs inside every rank of a real job, so that the collectives are the ones users get:

    accel launch --cpu --num_processes 2 benchmarks/ranked_pytest.py benchmarks/bench_gather.py --benchmark-only

(`make bench-gather` runs it on 2 and 4 ranks and writes docs/benchmarks/gather.md and gather.png.) Every test
uses fixed rounds and iterations (`benchmark.pedantic`) so that all ranks make the same calls; rank 0 reports.

Groups, per payload (bytes per rank; rank r sends r*64 bytes fewer, so there is padding to do):
- `limit`: a memcpy of the gathered bytes (world_size * payload) into a fresh buffer, the floor.
- `shm`: `pad_across_processes` then `gather`, as a user writes it (two rendezvous, shared memory).
- `shm_fused`: the same result in one call (`accel::shm_all_gather` with `pad_dim=0`).
- `reference`: the same two calls through accel's torch.distributed transport (gloo).
- `hf`: HF Accelerate's `pad_across_processes` then `gather` (skipped with a notice when not installed).
And one group timing a whole `gather_for_metrics` evaluation pass over an uneven dataset.
"""

import os

import pytest
import torch

from accel.collectives import gather, pad_across_processes
from accel.collectives.transport import TorchDistributedTransport, select_transport, using_transport

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = pytest.mark.skipif(WORLD_SIZE < 2, reason="run under `accel launch --num_processes N` (see docstring)")

PAYLOADS = {"64B": 64, "4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "32MiB": 32 << 20}
# (rounds, iterations): the same on every rank, so every rank runs the same number of collectives.
REPEATS = {"64B": (15, 200), "4KiB": (15, 200), "256KiB": (10, 20), "4MiB": (7, 3), "32MiB": (5, 1)}


@pytest.fixture(scope="module")
def state():
    from accel.state import PartialState

    return PartialState()


@pytest.fixture(params=list(PAYLOADS), ids=list(PAYLOADS))
def payload(request, state):
    name = request.param
    size = PAYLOADS[name] - 64 * state.process_index if PAYLOADS[name] > 64 else PAYLOADS[name] - state.process_index
    return name, torch.ones(size, dtype=torch.uint8) * state.process_index


def measure(benchmark, state, name, fn, *args):
    rounds, iterations = REPEATS[name]
    benchmark.group = f"gather {name}/rank x {WORLD_SIZE} ranks"
    benchmark.extra_info.update(world_size=WORLD_SIZE, payload=name)
    return benchmark.pedantic(fn, args=args, rounds=rounds, iterations=iterations, warmup_rounds=2)


def test_limit(benchmark, state, payload):
    name, tensor = payload
    source = torch.ones(PAYLOADS[name] * WORLD_SIZE, dtype=torch.uint8)
    measure(benchmark, state, name, lambda: torch.empty_like(source).copy_(source))


def test_shm(benchmark, state, payload):
    name, tensor = payload
    assert type(select_transport([])).__name__ == "SharedMemoryTransport"
    measure(benchmark, state, name, lambda: gather(pad_across_processes(tensor)))


def test_shm_fused(benchmark, state, payload):
    from accel import ops

    name, tensor = payload
    handle = select_transport([]).handle
    measure(benchmark, state, name, lambda: ops.shm_all_gather(handle, [tensor], 0, 0, False))


def test_reference(benchmark, state, payload):
    name, tensor = payload
    with using_transport(TorchDistributedTransport()):
        measure(benchmark, state, name, lambda: gather(pad_across_processes(tensor)))


def test_hf(benchmark, state, payload):
    hf = pytest.importorskip("accelerate", reason="HF Accelerate is not installed: `pip install accelerate`")
    hf.PartialState(cpu=True)
    name, tensor = payload
    measure(benchmark, state, name, lambda: hf.utils.gather(hf.utils.pad_across_processes(tensor)))


# --- a whole evaluation pass -------------------------------------------------------------------------------------


def _eval_loader(prepare):
    """1001 samples of 256 floats in batches of 16: the last batch is uneven and partly duplicated."""
    dataset = torch.utils.data.TensorDataset(torch.randn(1001, 256), torch.arange(1001))
    return prepare(torch.utils.data.DataLoader(dataset, batch_size=16))


def _eval_pass(loader, gather_for_metrics):
    seen = 0
    for features, labels in loader:
        predictions = features.sum(dim=1)
        gathered, gathered_labels = gather_for_metrics((predictions, labels))
        seen += len(gathered_labels)
    assert seen == 1001


def _eval(benchmark, state, prepare, gather_for_metrics):
    benchmark.group = f"gather_for_metrics eval pass, {WORLD_SIZE} ranks"
    loader = _eval_loader(prepare)
    benchmark.pedantic(_eval_pass, args=(loader, gather_for_metrics), rounds=5, iterations=1, warmup_rounds=1)


def test_eval_pass_limit(benchmark, state):
    """The same loop with no gather: what the evaluation costs without communication."""
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    benchmark.group = f"gather_for_metrics eval pass, {WORLD_SIZE} ranks"
    loader = _eval_loader(accelerator.prepare)

    def no_gather(data):
        return tuple(torch.cat([part] * WORLD_SIZE) for part in data)

    benchmark.pedantic(_loop_without_assert, args=(loader, no_gather), rounds=5, iterations=1, warmup_rounds=1)


def _loop_without_assert(loader, gather_for_metrics):
    for features, labels in loader:
        gather_for_metrics((features.sum(dim=1), labels))


def test_eval_pass_shm(benchmark, state):
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    _eval(benchmark, state, accelerator.prepare, accelerator.gather_for_metrics)


def test_eval_pass_reference(benchmark, state):
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    with using_transport(TorchDistributedTransport()):
        _eval(benchmark, state, accelerator.prepare, accelerator.gather_for_metrics)


def test_eval_pass_hf(benchmark, state):
    hf = pytest.importorskip("accelerate", reason="HF Accelerate is not installed: `pip install accelerate`")
    accelerator = hf.Accelerator(cpu=True)
    _eval(benchmark, state, accelerator.prepare, accelerator.gather_for_metrics)
