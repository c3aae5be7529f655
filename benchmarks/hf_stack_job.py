"""One rank of a job timed by bench_hf_stack.py: a tiny GPT-2 trained by transformers' `Trainer` (`lm`) or TRL's
`SFTTrainer` (`sft`), or the same model and batches in a raw torch DDP loop (`--runner raw`).

    accel launch --cpu --num_processes 2 --as_accelerate benchmarks/hf_stack_job.py --runner trainer --task lm --out r
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 benchmarks/hf_stack_job.py --runner trainer --task lm --out r
    torchrun --nproc_per_node 2 benchmarks/hf_stack_job.py --runner raw --group shm --task lm --out r

The trainer runner imports `accelerate` only through transformers / TRL, so the same file runs on HF Accelerate and
on accel standing in for it. The raw runner is what a user writes with torch alone (DDP configured as the `Trainer`
configures it, fused AdamW, a linear schedule, `clip_grad_norm_`), over plain gloo (`--group gloo`) or over gloo with
accel's shared-memory backend underneath (`--group shm`: what accel's `PartialState` sets up). Everything is built in
memory from seeds (a word-level tokenizer over made-up words, the texts, the model from a config): no files, no
network.

Each rank stamps the phases of every optimizer step (`PHASES`); after `--warmup` steps, the rate is `--steps` over
the time from the last warm-up step's end to the last step's end (everything between steps included: data,
logging, callbacks). Each rank writes `--out`/rank<N>.json: {"steps_per_s", "cpu_ms_per_step" (the process's CPU
time, all its threads, per timed step), "phase_ms" (each phase's median over the timed steps), "losses" (the
trainer's logged ones, every LOGGING_STEPS; the raw loop's every step), "peak_rss_bytes" (the process's high-water
mark, start-up included), "library"}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time
from pathlib import Path

import torch

SEQUENCE, BATCH, LOGGING_STEPS, LEARNING_RATE, MAX_GRAD_NORM = 64, 8, 10, 5e-5, 1.0
WORDS = [f"w{i}" for i in range(1000)]
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
# A step's phases, each from the previous stamp: `data` (the next batches, the Trainer's token count across ranks,
# its logging), `forward_backward` (gradient sync and clipping included), `optimizer`, `schedule_zero_grad`.
PHASES = ("data", "forward_backward", "optimizer", "schedule_zero_grad")


def corpus(count: int = 3000, seed: int = 0) -> list[str]:
    """`count` texts of 2 to 6 sentences of made-up words, Zipf-distributed as words are."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]
    return [
        " . ".join(" ".join(rng.choices(WORDS, weights, k=rng.randint(5, 12))) for _ in range(rng.randint(2, 6)))
        for _ in range(count)
    ]


def tokenizer():
    """A word-level tokenizer over WORDS that appends [EOS], as a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(SPECIAL + ["."] + WORDS)}
    core = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 3)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )


def model(tok):
    """GPT-2, 2 layers of width 64 (170 k parameters, most of them the embedding tied to the output layer)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=SEQUENCE,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def packed_blocks(tok, texts: list[str]) -> list[dict]:
    """run_clm's packing: the texts tokenized, concatenated and cut into SEQUENCE-token examples (`lm`)."""
    ids = [token for text in texts for token in tok(text)["input_ids"]]
    blocks = []
    for start in range(0, len(ids) - SEQUENCE + 1, SEQUENCE):
        chunk = torch.tensor(ids[start : start + SEQUENCE])
        blocks.append({"input_ids": chunk, "attention_mask": torch.ones_like(chunk), "labels": chunk.clone()})
    return blocks


class StepClock:
    """Stamps of each step's phases. Also a `TrainerCallback` (duck-typed: transformers calls the hooks it finds)
    whose hooks stamp the Trainer's steps."""

    def __init__(self):
        self.stamps: list[list[float]] = []  # per step: the end of each of PHASES
        self.cpu_ends: list[float] = []  # per step: this process's CPU time (all its threads) at its end
        self._open: list[float] = []

    def stamp(self) -> None:
        self._open.append(time.perf_counter())
        if len(self._open) == len(PHASES):
            self.stamps.append(self._open)
            self.cpu_ends.append(time.process_time())
            self._open = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.stamp()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.stamp()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.stamp()

    def on_step_end(self, args, state, control, **kwargs):
        self.stamp()

    def __getattr__(self, name):
        if name.startswith("on_"):  # the Trainer's other events
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def report(self, warmup: int, steps: int) -> dict:
        assert len(self.stamps) == warmup + steps and not self._open, f"{len(self.stamps)} steps stamped"
        ends = [step[-1] for step in self.stamps]
        phases = {name: [] for name in PHASES}
        for previous, step in zip(ends[warmup - 1 :], self.stamps[warmup:]):
            for name, start, end in zip(PHASES, [previous, *step[:-1]], step):
                phases[name].append(end - start)
        return {
            "steps_per_s": steps / (ends[-1] - ends[warmup - 1]),
            "cpu_ms_per_step": (self.cpu_ends[-1] - self.cpu_ends[warmup - 1]) / steps * 1e3,
            "phase_ms": {name: statistics.median(times) * 1e3 for name, times in phases.items()},
        }


def trainer_run(task: str, steps: int, out_dir: Path, clock: StepClock) -> tuple[list[float], str]:
    """Trains with the Trainer / SFTTrainer; (the logged losses, the Accelerator's module)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    tok = tokenizer()
    texts = corpus()
    common = dict(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LEARNING_RATE,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=LOGGING_STEPS,
        save_strategy="no",
        eval_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if task == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(max_length=SEQUENCE, gradient_checkpointing=False, **common)
        trainer = SFTTrainer(
            model=model(tok),
            args=config,
            train_dataset=Dataset.from_dict({"text": texts}),
            processing_class=tok,
            callbacks=[clock],
        )
    else:
        trainer = Trainer(
            model=model(tok),
            args=TrainingArguments(**common),
            train_dataset=packed_blocks(tok, texts),
            data_collator=default_data_collator,
            callbacks=[clock],
        )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, type(trainer.accelerator).__module__


def raw_batches(task: str, tok, rank: int, world: int) -> list[dict]:
    """This rank's batches: the `lm` blocks, or for `sft` the texts truncated to SEQUENCE tokens, each batch padded
    to its longest with the padding left out of the loss (what TRL's collator makes of them)."""
    generator = torch.Generator().manual_seed(0)
    texts = corpus()
    if task == "lm":
        examples = packed_blocks(tok, texts)
        order = torch.randperm(len(examples), generator=generator).tolist()
        mine = [examples[i] for i in order[rank::world]]
        return [
            {key: torch.stack([e[key] for e in mine[i : i + BATCH]]) for key in mine[0]}
            for i in range(0, len(mine) - BATCH + 1, BATCH)
        ]
    order = torch.randperm(len(texts), generator=generator).tolist()
    mine = [texts[i] for i in order[rank::world]]
    batches = []
    for i in range(0, len(mine) - BATCH + 1, BATCH):
        encoded = tok(mine[i : i + BATCH], truncation=True, max_length=SEQUENCE, padding=True, return_tensors="pt")
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        batches.append(
            {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels}
        )
    return batches


def raw_run(task: str, group: str, steps: int, clock: StepClock) -> list[float]:
    """The same model and data in a plain DDP loop; every step's loss."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if group == "shm":
        from accel.wire.shm_process_group import share_memory_in_default_group

        assert share_memory_in_default_group() is not None, "the ranks could not share memory"
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = tokenizer()
    # As the Trainer wraps a model that does not checkpoint activations (its ddp_find_unused_parameters default).
    ddp = torch.nn.parallel.DistributedDataParallel(model(tok), find_unused_parameters=True)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True)  # the Trainer's
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / steps))
    batches = raw_batches(task, tok, rank, world)
    losses = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        clock.stamp()
        loss = ddp(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_GRAD_NORM)
        clock.stamp()
        optimizer.step()
        clock.stamp()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        clock.stamp()
    dist.destroy_process_group()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("trainer", "raw"), required=True)
    parser.add_argument("--task", choices=("lm", "sft"), required=True)
    parser.add_argument("--group", choices=("gloo", "shm"), default="gloo", help="the raw runner's group")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", required=True, help="folder for rank<N>.json")
    args = parser.parse_args()
    clock, total = StepClock(), args.warmup + args.steps
    if args.runner == "trainer":
        losses, library = trainer_run(args.task, total, Path(args.out) / "trainer", clock)
    else:
        losses, library = raw_run(args.task, args.group, total, clock), f"torch DDP over {args.group}"
    report = {
        **clock.report(args.warmup, args.steps),
        "losses": losses,
        "library": library,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
