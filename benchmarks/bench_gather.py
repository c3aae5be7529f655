"""The padded all-gather through the public API, side by side with HF Accelerate, interleaved in one run.

Runs inside every rank of a real job, so that the collectives are the ones users get:

    accel launch --cpu --num_processes 2 benchmarks/ranked_pytest.py benchmarks/bench_gather.py --benchmark-only

(`make bench-gather` runs it on 2 and 4 ranks, installing HF Accelerate first, and writes
docs/benchmarks/gather.md and gather.png.) Every rank makes the same calls in the same order; rank 0 reports.

Per payload (bytes per rank; rank r sends r*64 bytes fewer, so there is padding to do), each round times, in
an order that alternates between rounds, the same number of calls of:
- `limit`: a memcpy of the gathered bytes (world_size * payload) into a fresh buffer, the floor;
- `accel`: `pad_across_processes` then `gather`, as a user writes it (accel's public API);
- `hf`: HF Accelerate's `pad_across_processes` then `gather` (its public API, over the plain gloo group its users
  have: while HF is timed, the default group's CPU collectives go to its gloo backend, see `plain_gloo`);
- `fused`: the same result in one op call (`accel::shm_all_gather` with `pad_dim=0`), the op-level column;
- `reference`: accel's two calls through its torch.distributed transport, over plain gloo too.
The ratio HF/accel is the median over rounds of each round's ratio (interleaved pairs), so drifts of a busy
machine hit both sides alike. A second group times whole `gather_for_metrics` evaluation passes the same way, and a
third the same pass with a small MLP's forward (issue 23): accel's pass, HF's pass, accel's forward-only pass
over the same prepared loader and model (the limit), and that pass with a barrier (`wait_for_everyone`) after each
forward, with what gathering and what a barrier add per batch (a barrier is the least any collective per batch
costs: one rendezvous, and each rank waiting for the slower one's forward). accel's three passes are timed until
every rank has finished (each ends with a barrier): the forward-only pass has no collective to line the ranks up.
ACCEL_BENCH_ROUNDS sets the rounds of the evaluation-pass benchmarks (default 21; a few suffice to check that they
run).
Everything lands in each benchmark's `extra_info` (benchmarks/report/gather.py reads it); pytest-benchmark's
own statistics are those of one whole round.

`test_pad_then_gather_one_gpu` (issue 25) runs without a launcher, in one process on a GPU, as a sanity point: the
same public calls of both libraries on a CUDA tensor (each batch of calls ends with `torch.cuda.synchronize()`),
against a copy of the payload on the GPU. One process has nothing to exchange: both should return the tensor as
it is, so this measures what each library costs a single-GPU user per call.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Callable

import pytest
import torch

from accel.collectives import gather, gather_object, pad_across_processes
from accel.wire.transport import TorchDistributedTransport
from accel.wire.transport_selection import select_transport, using_transport

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
multi_rank = pytest.mark.skipif(WORLD_SIZE < 2, reason="run under `accel launch --num_processes N` (see docstring)")
one_gpu = pytest.mark.skipif(WORLD_SIZE != 1 or not torch.cuda.is_available(), reason="one process with a GPU")

PAYLOADS = {"64B": 64, "4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "32MiB": 32 << 20}
# (rounds, calls per contender and round): the same on every rank, so every rank runs the same collectives.
REPEATS = {"64B": (21, 100), "4KiB": (21, 100), "256KiB": (15, 10), "4MiB": (15, 8), "32MiB": (9, 2)}
EVAL_ROWS, EVAL_BATCH = 1003, 16
EVAL_ROUNDS = int(os.environ.get("ACCEL_BENCH_ROUNDS", "21"))  # of each evaluation-pass benchmark


def hf_accelerate():
    """HF Accelerate (the comparison), or a skip naming how to get it."""
    return pytest.importorskip("accelerate", reason="HF Accelerate is not installed: `pip install accelerate`")


_GLOO: list = []  # the default group's gloo backend, kept by `state`


@pytest.fixture(scope="module")
def state():
    """accel's PartialState over a default group started here as gloo: PartialState makes it share memory, as it
    does for every group it finds (accel's backend, with that gloo backend as its delegate), and accel's calls are
    timed on that group, as accel's users have it. HF's are timed on the gloo backend alone (`plain_gloo`)."""
    import torch.distributed as dist

    from accel.state import PartialState

    dist.init_process_group("gloo")
    _GLOO[:] = [dist.group.WORLD._get_backend(torch.device("cpu"))]
    state = PartialState()
    assert dist.group.WORLD._get_backend(torch.device("cpu")).name() == "accel", "the group does not share memory"
    return state


@contextlib.contextmanager
def plain_gloo():
    """The default group's CPU collectives go to its gloo backend inside the block (what HF Accelerate's users have:
    HF calls torch.distributed on the default group), and to accel's shared-memory backend again after it."""
    import torch.distributed as dist

    group, cpu = dist.group.WORLD, torch.device("cpu")
    ours = group._get_backend(cpu)
    group._register_backend(cpu, dist.ProcessGroup.BackendType.GLOO, _GLOO[0])
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    assert group._get_backend(cpu).name() == "gloo"
    try:
        yield
    finally:
        group._register_backend(cpu, dist.ProcessGroup.BackendType.CUSTOM, ours)
        group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)


def timed(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of `fn`, over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _start_together() -> None:
    """Every rank starts the next timing at once (outside the timing): a timing that began while a peer was still
    finishing the previous contender would bill this contender for that lag (a loop without collectives, such as an
    evaluation pass's forward-only limit, lets the ranks drift apart by up to its whole length)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Interleaved:
    """Times contenders round after round, alternating their order; the same calls on every rank, each timing
    started on every rank at once."""

    def __init__(
        self,
        contenders: dict[str, Callable[[], object]],
        calls: int,
        timer: Callable[[Callable[[], object], int], float] = timed,
        over_gloo: tuple[str, ...] = (),
    ):
        """`over_gloo`: the contenders timed inside `plain_gloo` (entered once per round, outside the timing)."""
        self.contenders, self.calls, self.timer, self.over_gloo = contenders, calls, timer, over_gloo
        self.times: dict[str, list[float]] = {name: [] for name in contenders}
        self.rounds = 0

    def round(self) -> None:
        names = list(self.contenders)
        for name in names if self.rounds % 2 == 0 else reversed(names):
            with plain_gloo() if name in self.over_gloo else contextlib.nullcontext():
                _start_together()
                self.times[name].append(self.timer(self.contenders[name], self.calls))
        self.rounds += 1

    def summary(self, versus: str, against: list[str]) -> dict:
        """Medians per contender (s), and for each of `against` the median of its per-round ratio to `versus`
        with the ratio's quartiles (the run-to-run spread)."""
        info = {"median_s": {name: statistics.median(times) for name, times in self.times.items()}}
        for other in against:
            ratios = sorted(o / v for o, v in zip(self.times[other], self.times[versus]))
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            info[f"{other}/{versus}"] = {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[-1]}
        return info


def _payload(state, name: str) -> torch.Tensor:
    size = PAYLOADS[name] - (64 if PAYLOADS[name] > 64 else 1) * state.process_index
    return torch.ones(size, dtype=torch.uint8) * state.process_index


def _gathers_match(state, tensor, hf) -> None:
    """accel's public path gives HF's result, bit for bit (checked once before timing)."""
    ours = gather(pad_across_processes(tensor))
    with plain_gloo():
        theirs = hf.utils.gather(hf.utils.pad_across_processes(tensor))
    assert torch.equal(ours, theirs.to(ours.dtype)) and ours.dtype == tensor.dtype


@multi_rank
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_pad_then_gather(benchmark, state, name):
    from accel import ops

    hf = hf_accelerate()
    hf.PartialState(cpu=True)  # joins the default (gloo) group
    assert type(select_transport([])).__name__ == "SharedMemoryTransport"
    tensor = _payload(state, name)
    _gathers_match(state, tensor, hf)
    handle, reference = select_transport([]).handle, TorchDistributedTransport()
    source = torch.ones(PAYLOADS[name] * WORLD_SIZE, dtype=torch.uint8)

    def through_reference():
        with using_transport(reference):
            return gather(pad_across_processes(tensor))

    rounds, calls = REPEATS[name]
    runs = Interleaved(
        {
            "limit": lambda: torch.empty_like(source).copy_(source),
            "accel": lambda: gather(pad_across_processes(tensor)),
            "hf": lambda: hf.utils.gather(hf.utils.pad_across_processes(tensor)),
            "fused": lambda: ops.shm_all_gather(handle, [tensor], 0, 0, False),
            "reference": through_reference,
        },
        calls,
        over_gloo=("hf", "reference"),
    )
    runs.round()  # warm-up (first-call costs of both libraries), not recorded
    runs.times = {contender: [] for contender in runs.times}
    benchmark.group = f"pad_across_processes + gather, {WORLD_SIZE} ranks"
    benchmark.pedantic(runs.round, rounds=rounds, iterations=1)
    benchmark.extra_info.update(
        world_size=WORLD_SIZE,
        payload=name,
        calls_per_round=calls,
        **runs.summary("accel", ["hf", "fused", "reference", "limit"]),
        per_rank_accel_median_s=gather_object([statistics.median(runs.times["accel"])]),
    )


# --- a whole evaluation pass -------------------------------------------------------------------------------------


def _eval_loader(prepare):
    """EVAL_ROWS samples of 256 floats in batches of EVAL_BATCH: the last batch is uneven and partly duplicated."""
    generator = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(EVAL_ROWS, 256, generator=generator), torch.arange(EVAL_ROWS))
    return prepare(torch.utils.data.DataLoader(dataset, batch_size=EVAL_BATCH))


def _eval_pass(loader, gather_for_metrics) -> torch.Tensor:
    labels = [gather_for_metrics((features.sum(dim=1), batch_labels))[1] for features, batch_labels in loader]
    return torch.cat(labels)


@multi_rank
def test_gather_for_metrics_eval_pass(benchmark, state):
    import accel

    hf = hf_accelerate()
    ours, theirs = accel.Accelerator(cpu=True), hf.Accelerator(cpu=True)
    our_loader, their_loader = _eval_loader(ours.prepare), _eval_loader(theirs.prepare)
    seen = _eval_pass(our_loader, ours.gather_for_metrics)
    with plain_gloo():
        assert torch.equal(seen, _eval_pass(their_loader, theirs.gather_for_metrics))
    assert torch.equal(seen, torch.arange(EVAL_ROWS))  # every sample once, in order

    def no_gather(data):
        return tuple(torch.cat([part] * WORLD_SIZE) for part in data)

    def through_reference():
        with using_transport(TorchDistributedTransport()):
            return _eval_pass(our_loader, ours.gather_for_metrics)

    runs = Interleaved(
        {
            "limit": lambda: _eval_pass(our_loader, no_gather),
            "accel": lambda: _eval_pass(our_loader, ours.gather_for_metrics),
            "hf": lambda: _eval_pass(their_loader, theirs.gather_for_metrics),
            "reference": through_reference,
        },
        1,
        over_gloo=("hf", "reference"),
    )
    benchmark.group = f"gather_for_metrics eval pass, {WORLD_SIZE} ranks"
    benchmark.pedantic(runs.round, rounds=EVAL_ROUNDS, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(
        world_size=WORLD_SIZE,
        rows=EVAL_ROWS,
        batch_size=EVAL_BATCH,
        **runs.summary("accel", ["hf", "reference", "limit"]),
    )


# --- an evaluation pass with a model (issue 23) ------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    """A small MLP over the loader's 256 features: 10 logits per sample; the same weights in every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _model_pass(model, loader, gather_for_metrics=None, sync=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An evaluation loop as users write it: predictions and labels of every batch through `gather_for_metrics`
    (none: the forward-only pass over the same loader), concatenated at the end. `sync`: called after each forward
    instead (a barrier: what any collective per batch costs at least, the ranks' waits for each other included)."""
    predictions, labels = [], []
    with torch.no_grad():
        for features, batch_labels in loader:
            batch_predictions = model(features).argmax(dim=-1)
            if sync is not None:
                sync()
            if gather_for_metrics is not None:
                batch_predictions, batch_labels = gather_for_metrics((batch_predictions, batch_labels))
                predictions.append(batch_predictions)
                labels.append(batch_labels)
    return (torch.cat(predictions), torch.cat(labels)) if gather_for_metrics is not None else None


class _TimeInside:
    """A per-batch call (the gather, the barrier) that adds up, per pass, the time spent inside it: the rest of the
    pass is the rank's own work (loader and forward). `start` opens a pass's tally; `per_pass` holds them."""

    def __init__(self, call: Callable) -> None:
        self.call, self.per_pass = call, []

    def start(self) -> None:
        self.per_pass.append(0.0)

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.call(*args)
        finally:
            self.per_pass[-1] += time.perf_counter() - start


def _until_every_rank_is_done(run_pass: Callable[[], object], barrier: Callable[[], object]) -> Callable[[], None]:
    """`run_pass`, timed until the last rank has finished it: a distributed pass is done when every rank is. A
    forward-only pass has no collective, so each rank's own time leaves out how much longer the slowest rank took,
    and the gathering pass would be billed for that difference (a rank that waits at each gather for a peer whose
    loader and forward are slower all along, not for the gather). accel's barrier adds ~5 µs to a pass. HF's pass
    is left as it is: its last gather already ends on every rank together, and a barrier over its gloo group
    would add a gloo round-trip (~1 ms here) to its time."""

    def run() -> None:
        run_pass()
        barrier()

    return run


@multi_rank
def test_eval_pass_with_model(benchmark, state):
    """accel's whole evaluation pass (forward + gather_for_metrics of (predictions, labels)) against the same pass
    without gathering (`forward`, the limit) and HF Accelerate's pass (its prepared model, loader and gather)."""
    import accel

    hf = hf_accelerate()
    ours, theirs = accel.Accelerator(cpu=True), hf.Accelerator(cpu=True)
    our_model, our_loader = ours.prepare(_mlp(), _eval_loader(lambda loader: loader))
    their_model, their_loader = theirs.prepare(_mlp(), _eval_loader(lambda loader: loader))
    our_model.eval()
    their_model.eval()
    seen = _model_pass(our_model, our_loader, ours.gather_for_metrics)
    with plain_gloo():
        theirs_seen = _model_pass(their_model, their_loader, theirs.gather_for_metrics)
    assert all(torch.equal(a, b) for a, b in zip(seen, theirs_seen))
    assert torch.equal(seen[1], torch.arange(EVAL_ROWS))  # every sample once, in order
    everyone = ours.wait_for_everyone
    barrier, gathering = _TimeInside(everyone), _TimeInside(ours.gather_for_metrics)

    def barrier_pass():
        barrier.start()
        _model_pass(our_model, our_loader, sync=barrier)

    def accel_pass():
        gathering.start()
        _model_pass(our_model, our_loader, gathering)

    runs = Interleaved(
        {
            "limit": _until_every_rank_is_done(lambda: _model_pass(our_model, our_loader), everyone),
            "barrier": _until_every_rank_is_done(barrier_pass, everyone),
            "accel": _until_every_rank_is_done(accel_pass, everyone),
            "hf": lambda: _model_pass(their_model, their_loader, theirs.gather_for_metrics),
        },
        1,
        over_gloo=("hf",),
    )
    runs.round()  # warm-up, not recorded
    runs.times = {contender: [] for contender in runs.times}
    barrier.per_pass, gathering.per_pass = [], []
    benchmark.group = f"evaluation pass with a model, {WORLD_SIZE} ranks"
    benchmark.pedantic(runs.round, rounds=EVAL_ROUNDS, iterations=1, warmup_rounds=0)
    # What gathering adds per batch, from each round's pair (the same loader and model, interleaved).
    per_batch = [(a - f) / len(our_loader) for a, f in zip(runs.times["accel"], runs.times["limit"])]
    barrier_per_batch = [(b - f) / len(our_loader) for b, f in zip(runs.times["barrier"], runs.times["limit"])]
    # Where that goes: the time inside the call, and the rank's own work (loader + forward) outside it, which is
    # not the same when the ranks run in step as when each runs free (the forward-only pass).
    batches = len(our_loader)
    own_work = {
        "free": [f / batches for f in runs.times["limit"]],
        "barrier": [(b - inside) / batches for b, inside in zip(runs.times["barrier"], barrier.per_pass)],
        "accel": [(a - inside) / batches for a, inside in zip(runs.times["accel"], gathering.per_pass)],
    }
    benchmark.extra_info.update(
        world_size=WORLD_SIZE,
        payload="eval+mlp",
        rows=EVAL_ROWS,
        batch_size=EVAL_BATCH,
        batches=len(our_loader),
        gather_per_batch_s=statistics.median(per_batch),
        barrier_per_batch_s=statistics.median(barrier_per_batch),
        inside_gather_per_batch_s=statistics.median(inside / batches for inside in gathering.per_pass),
        inside_barrier_per_batch_s=statistics.median(inside / batches for inside in barrier.per_pass),
        own_work_per_batch_s={name: statistics.median(times) for name, times in own_work.items()},
        **runs.summary("accel", ["hf"]),
    )
    benchmark.extra_info["accel/limit"] = runs.summary("limit", ["accel"])["accel/limit"]


# --- one process on a GPU (issue 25) -----------------------------------------------------------------------------


def timed_on_gpu(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of `fn` over `calls` calls, the GPU's queued work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


@one_gpu
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_pad_then_gather_one_gpu(benchmark, name):
    from accel.state import PartialState

    hf = hf_accelerate()
    PartialState._reset_state()
    PartialState()
    hf.state.PartialState._reset_state()
    hf.PartialState()
    tensor = torch.ones(PAYLOADS[name], dtype=torch.uint8, device="cuda")
    ours, theirs = gather(pad_across_processes(tensor)), hf.utils.gather(hf.utils.pad_across_processes(tensor))
    assert ours.is_cuda and torch.equal(ours, theirs)
    _, calls = REPEATS[name]
    runs = Interleaved(
        {
            "limit": lambda: torch.empty_like(tensor).copy_(tensor),
            "accel": lambda: gather(pad_across_processes(tensor)),
            "hf": lambda: hf.utils.gather(hf.utils.pad_across_processes(tensor)),
        },
        calls,
        timer=timed_on_gpu,
    )
    runs.round()  # warm-up, not recorded
    runs.times = {contender: [] for contender in runs.times}
    benchmark.group = "pad_across_processes + gather, 1 GPU"
    benchmark.pedantic(runs.round, rounds=9, iterations=1)
    benchmark.extra_info.update(
        world_size=1,
        device="cuda",
        gpu=torch.cuda.get_device_name(),
        payload=name,
        calls_per_round=calls,
        **runs.summary("accel", ["hf", "limit"]),
    )
