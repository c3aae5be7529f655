"""One rank of a job timed by bench_fsdp2.py: a GPT-2 of a few million parameters trained on 2 CPU processes
under accel's Accelerator (FSDP2 or DDP, as the launcher says), or under torch's `fully_shard` in a hand-written
loop; or accel's FSDP2 checkpoint saves against torch's `dcp.save` of the same state.

    accel launch --cpu --num_processes 2 --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \\
        --fsdp_transformer_layer_cls_to_wrap GPT2Block benchmarks/fsdp2_job.py --runner accel --out r
    accel launch --cpu --num_processes 2 benchmarks/fsdp2_job.py --runner accel --out r          # DDP
    torchrun --nproc_per_node 2 benchmarks/fsdp2_job.py --runner raw --group gloo --out r       # or --group shm
    accel launch ... --use_fsdp ... benchmarks/fsdp2_job.py --runner checkpoint --out r

`accel`: the loop a user writes on the Accelerate API (`prepare`, `backward`, `clip_grad_norm_`, AdamW); whether
it runs FSDP2 or DDP is the launcher's choice (ACCEL_USE_FSDP and HF's FSDP_* variables). `raw`: what a user writes
with torch alone: `fully_shard` on every GPT2Block then on the root, AdamW, `torch.nn.utils.clip_grad_norm_`, over
plain gloo (`--group gloo`) or over gloo with accel's shared-memory backend underneath (`--group shm`, what accel's
`PartialState` sets up). Every runner trains the same model (seeded, dropout off) on the same batches (each rank
its own, seeded by its rank).

Training runners: after `--warmup` steps, each rank times `--steps` steps, stamping each step's phases (`PHASES`),
and writes `--out`/rank<N>.json: {"steps_per_s", "cpu_ms_per_step", "phase_ms" and "cpu_phase_ms" (each phase's
median wall and CPU time), "losses" (every step,
warm-up included), "resident_bytes" ({"parameters", "gradients", "optimizer"}: the bytes this rank holds, local
shards only, after the last optimizer step), "largest_unit_bytes" (the parameters of the largest FSDP unit, whole;
0 without FSDP), "peak_rss_bytes", "strategy", "backend"}.

Checkpoint runner (FSDP2 under accel): after 3 steps, each save once (the run's first, `first_s`, reported apart:
accel's builds what later saves refresh), then `--repeats` times each, in an order that alternates, each timed from
a barrier to the slowest rank's return: with `--pair sync`, `save_state(dir)` (synchronous) and torch's
`dcp.save` of the same model and optimizer state, and the same in HF's layout (two `dcp.save`, the model's and
the optimizer's folders); with `--pair async`, `save_state(dir, async_save=True)` (its
background work joined after the timing) and a memcpy of this rank's shards (parameters and optimizer state) into
buffers allocated beforehand: what any snapshot must copy. Rank 0 writes `--out`/checkpoint.json with the times
(`times_s`, `first_s`) and `async_writes_on_caller`: whether an asynchronous save wrote its shards on the calling
thread before returning (it is then synchronous).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

SEQUENCE, BATCH, VOCABULARY, LEARNING_RATE, MAX_GRAD_NORM = 32, 4, 1024, 1e-3, 1.0
WIDTH, LAYERS, HEADS = 256, 4, 4
# A step's phases, each from the previous stamp: forward + backward (FSDP's gathers and reduce-scatters, DDP's
# all-reduce), the gradient clip, the optimizer step, zero_grad.
PHASES = ("forward_backward", "clip", "optimizer", "zero_grad")


def gpt2(width: int = WIDTH):
    """GPT-2 of 4 layers of width 256 (3.4 M parameters, 0.26 M of them the embedding tied to the output layer);
    the checkpoint runner also saves one of GPT-2 small's width, 768 (29.1 M parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=SEQUENCE,
        n_embd=width,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def rank_batches(rank: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator) for _ in range(count)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of this rank's parameters, gradients and optimizer state (local shards only)."""

    def size(tensor):
        return local(tensor).numel() * local(tensor).element_size()

    parameters = list(model.parameters())
    return {
        "parameters": sum(size(p) for p in parameters),
        "gradients": sum(size(p.grad) for p in parameters if p.grad is not None),
        "optimizer": sum(
            size(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    }


def largest_unit_bytes(model: torch.nn.Module) -> int:
    """The bytes of the largest FSDP unit's parameters, whole (what it gathers); 0 when nothing is sharded."""
    from torch.distributed.fsdp import FSDPModule

    claimed: set[int] = set()
    sizes = []
    # Children before their parents (reversed pre-order): a unit's own parameters are those no inner unit holds.
    for unit in reversed([m for m in model.modules() if isinstance(m, FSDPModule)]):
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed |= {id(p) for p in own}
        sizes.append(sum(p.numel() * p.element_size() for p in own))
    return max(sizes, default=0)


def memory_facts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"resident_bytes": resident_bytes(model, optimizer), "largest_unit_bytes": largest_unit_bytes(model)}


class StepClock:
    """Stamps of each step's phases: the wall time and this process's CPU time (all its threads) at each."""

    def __init__(self):
        self.stamps: list[list[float]] = []
        self.cpu_stamps: list[list[float]] = []

    def start(self) -> None:
        self.stamps.append([time.perf_counter()])
        self.cpu_stamps.append([time.process_time()])

    def stamp(self) -> None:
        self.stamps[-1].append(time.perf_counter())
        self.cpu_stamps[-1].append(time.process_time())

    def report(self, warmup: int, steps: int) -> dict:
        timed, cpu = self.stamps[warmup:], self.cpu_stamps[warmup:]
        assert len(timed) == steps, f"{len(timed)} timed steps"

        def phases(stamps):
            return {
                name: statistics.median(step[i + 1] - step[i] for step in stamps) * 1e3 for i, name in enumerate(PHASES)
            }

        return {
            "steps_per_s": steps / (timed[-1][-1] - self.stamps[warmup - 1][-1]),
            "cpu_ms_per_step": (cpu[-1][-1] - self.cpu_stamps[warmup - 1][-1]) / steps * 1e3,
            "phase_ms": phases(timed),
            "cpu_phase_ms": phases(cpu),
        }


def accel_training(steps: int, clock: StepClock) -> tuple[list[float], dict]:
    """The loop on accel's public API; (every step's loss, facts about the run)."""
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, facts = [], {}
    for step, tokens in enumerate(rank_batches(accelerator.process_index, steps)):
        clock.start()
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        clock.stamp()
        accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        clock.stamp()
        optimizer.step()
        clock.stamp()
        if step == steps - 1:
            facts = memory_facts(model, optimizer)
        optimizer.zero_grad()
        clock.stamp()
        losses.append(loss.item())
    facts["strategy"] = "FSDP2" if accelerator.is_fsdp2 else str(accelerator.distributed_type)
    facts["backend"] = dist.group.WORLD._get_backend(torch.device("cpu")).name()
    accelerator.end_training()
    return losses, facts


def raw_model() -> torch.nn.Module:
    """The model under torch's fully_shard: each GPT2Block, then the root."""
    from torch.distributed.fsdp import fully_shard

    model = gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def raw_training(group: str, steps: int, clock: StepClock) -> tuple[list[float], dict]:
    """The hand-written torch loop; (every step's loss, facts about the run)."""
    dist.init_process_group("gloo")
    if group == "shm":
        from accel.wire.shm_process_group import share_memory_in_default_group

        assert share_memory_in_default_group() is not None, "the ranks could not share memory"
    model = raw_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses, facts = [], {}
    for step, tokens in enumerate(rank_batches(dist.get_rank(), steps)):
        clock.start()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        clock.stamp()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        clock.stamp()
        optimizer.step()
        clock.stamp()
        if step == steps - 1:
            facts = memory_facts(model, optimizer)
        optimizer.zero_grad()
        clock.stamp()
        losses.append(loss.item())
    facts.update(strategy="torch fully_shard", backend=dist.group.WORLD._get_backend(torch.device("cpu")).name())
    dist.destroy_process_group()
    return losses, facts


class CallerWrites:
    """Counts DCP's file writes that run on the thread that installed it (a save that writes them before it
    returns is synchronous)."""

    def __init__(self):
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        self.count, self._thread, self._original = 0, threading.get_ident(), FileSystemWriter.write_data
        counter = self

        def write_data(writer, plan, planner):
            if threading.get_ident() == counter._thread:
                counter.count += 1
            return counter._original(writer, plan, planner)

        FileSystemWriter.write_data = write_data


def slowest(seconds: float) -> float:
    """The slowest rank's time (every rank calls it)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed(call) -> float:
    dist.barrier()
    started = time.perf_counter()
    call()
    return slowest(time.perf_counter() - started)


def checkpoint_run(pair: str, repeats: int, width: int, out: Path) -> dict:
    """`pair`'s two ways of saving (see SAVES), `repeats` times each in turn; the slowest rank's time of each."""
    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.is_fsdp2, "launch the checkpoint runner with --use_fsdp"
    model = gpt2(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    model, optimizer = accelerator.prepare(model, optimizer)
    for tokens in rank_batches(accelerator.process_index, 3):  # the optimizer's state exists from the first step
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
    saves = Saves(accelerator, model, optimizer, out / "saves")
    # The run's first save of each kind is reported apart: accel's builds the trees and the copy later saves
    # refresh, the memcpy faults its buffers in; the repeats measure the saves a training loop makes after it.
    first = {}
    for name in SAVES[pair]:
        first[name] = timed(lambda: getattr(saves, name)(-1))
        saves.clean()
    times: dict[str, list[float]] = {name: [] for name in SAVES[pair]}
    for repeat in range(repeats):
        for name in SAVES[pair] if repeat % 2 == 0 else SAVES[pair][::-1]:
            times[name].append(timed(lambda: getattr(saves, name)(repeat)))
            saves.clean()
    report = {
        "times_s": times,
        "first_s": first,
        "shard_bytes": saves.shard_bytes(),
        "async_writes_on_caller": saves.async_on_caller,
    }
    accelerator.end_training()
    return report


# Each pair the checkpoint runner times: accel's save first, then its reference.
SAVES = {"sync": ("save_state", "dcp_save", "dcp_save_hf_layout"), "async": ("save_state_async", "memcpy")}


class Saves:
    """The saves the checkpoint runner times (methods named as in SAVES), each into a folder of its own."""

    def __init__(self, accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path):
        self.accelerator, self.model, self.optimizer, self.folder = accelerator, model, optimizer, folder
        self.shards = [local(p).detach() for p in model.parameters()]
        self.shards += [
            local(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        self.buffers = [torch.empty_like(shard) for shard in self.shards]
        self.writes = CallerWrites()
        self.async_on_caller = False

    def save_state(self, repeat: int) -> None:
        self.accelerator.save_state(str(self.folder / f"sync{repeat}"))

    def dcp_save(self, repeat: int) -> None:
        """What a torch user writes: the model's and the optimizer's sharded state in one DCP checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }
        dcp.save(state, checkpoint_id=str(self.folder / f"dcp{repeat}"))

    def dcp_save_hf_layout(self, repeat: int) -> None:
        """The same state in HF's layout, as save_state writes it: the model's and the optimizer's in DCP
        checkpoints of their own (`pytorch_model_fsdp_0/`, `optimizer_0/`)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        folder = self.folder / f"layout{repeat}"
        dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
        dcp.save(
            {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)},
            checkpoint_id=str(folder / "optimizer_0"),
        )

    def save_state_async(self, repeat: int) -> None:
        before = self.writes.count
        self.accelerator.save_state(str(self.folder / f"async{repeat}"), async_save=True)
        self.async_on_caller |= self.writes.count > before

    def memcpy(self, repeat: int) -> None:
        for buffer, shard in zip(self.buffers, self.shards):
            buffer.copy_(shard)

    def clean(self) -> None:
        """Waits for background saves, then removes every save (untimed)."""
        self.accelerator.wait_for_checkpoint()
        if self.accelerator.is_main_process:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def shard_bytes(self) -> int:
        """The largest rank's bytes of parameter and optimizer shards (every rank calls it)."""
        value = torch.tensor([sum(s.numel() * s.element_size() for s in self.shards)], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("accel", "raw", "checkpoint"), required=True)
    parser.add_argument("--group", choices=("gloo", "shm"), default="gloo", help="the raw runner's group")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pair", choices=list(SAVES), default="sync", help="the checkpoint runner's saves")
    parser.add_argument("--repeats", type=int, default=5, help="the checkpoint runner's saves of each kind")
    parser.add_argument("--width", type=int, default=WIDTH, help="the checkpoint runner's GPT-2 width")
    parser.add_argument("--out", required=True, help="folder for rank<N>.json (checkpoint.json)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.runner == "checkpoint":
        report = checkpoint_run(args.pair, args.repeats, args.width, out)
        if os.environ["RANK"] == "0":
            (out / "checkpoint.json").write_text(json.dumps(report))
        return
    clock, total = StepClock(), args.warmup + args.steps
    if args.runner == "accel":
        losses, facts = accel_training(total, clock)
    else:
        losses, facts = raw_training(args.group, total, clock)
    report = {
        **clock.report(args.warmup, args.steps),
        **facts,
        "losses": losses,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
