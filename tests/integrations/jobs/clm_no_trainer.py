"""Causal language modelling without `Trainer`, on the Accelerate API directly: the paths transformers'
`run_clm_no_trainer.py` example takes (accel's own script, written for these tests). A tiny GPT-2 built from a
config, a local tokenizer and local text files; `--checkpointing_steps` saves `step_N` / `epoch_N` folders with
`save_state`, `--resume_from_checkpoint` loads one and skips the batches already seen, `--with_tracking` logs to
TensorBoard through `init_trackers` / `log`, and evaluation gathers the losses with `gather_for_metrics`.

It imports `accelerate`, so it runs under HF Accelerate or under accel standing in for it. Besides the tracker,
rank 0 writes `results.json` (each optimizer step's loss, the evaluation) for the tests to compare.
"""

import argparse
import json
import math
import os
import pathlib
from itertools import chain

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, default_data_collator, get_scheduler

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--checkpointing_steps", default=None, help="N (every N optimizer steps) or 'epoch'")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", default="tensorboard")
    return parser.parse_args()


def load_blocks(args, tokenizer, accelerator):
    extension = pathlib.Path(args.train_file).suffix.lstrip(".")
    extension = "text" if extension == "txt" else extension
    raw = load_dataset(extension, data_files={"train": args.train_file, "validation": args.validation_file})

    def tokenize(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // args.block_size * args.block_size
        blocks = {k: [t[i : i + args.block_size] for i in range(0, total, args.block_size)] for k, t in joined.items()}
        blocks["labels"] = blocks["input_ids"].copy()
        return blocks

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
        return tokenized.map(group_texts, batched=True)


def resume_point(args, accelerator, batches_per_epoch):
    """(first epoch, batches of it to skip, optimizer steps done) after loading the checkpoint."""
    if not args.resume_from_checkpoint:
        return 0, 0, 0
    accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
    accelerator.load_state(args.resume_from_checkpoint)
    name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
    if name.startswith("epoch_"):
        epoch = int(name.replace("epoch_", "")) + 1
        return epoch, 0, epoch * math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    batches = int(name.replace("step_", "")) * args.gradient_accumulation_steps
    return batches // batches_per_epoch, batches % batches_per_epoch, batches // args.gradient_accumulation_steps


def steps_per_update(dataloader, args):
    return math.ceil(len(dataloader) / args.gradient_accumulation_steps)


def evaluate(model, eval_dataloader, accelerator, batch_size):
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch_size)))
    eval_loss = torch.mean(torch.cat(losses))
    try:
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    return eval_loss.item(), perplexity


def main():
    args = parse_args()
    tracking = {"log_with": args.report_to, "project_dir": args.output_dir} if args.with_tracking else {}
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **tracking)
    set_seed(args.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_name)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2))
    data = load_blocks(args, tokenizer, accelerator)
    train_dataloader = DataLoader(
        data["train"], shuffle=True, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        data["validation"], collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )
    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    # As the example: the schedule is sized before `prepare` shards the data, from the whole dataloader's length
    # when --max_train_steps is not given; the step count is then recomputed from the sharded length.
    overrode_max_train_steps = args.max_train_steps is None
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_update(train_dataloader, args)
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps if overrode_max_train_steps else max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if overrode_max_train_steps:
        max_train_steps = args.num_train_epochs * steps_per_update(train_dataloader, args)
    num_train_epochs = math.ceil(max_train_steps / steps_per_update(train_dataloader, args))
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", {k: v for k, v in vars(args).items() if v is not None})
    logger.info(f"  Num examples = {len(data['train'])}, total optimization steps = {max_train_steps}")

    starting_epoch, skip_batches, completed_steps = resume_point(args, accelerator, len(train_dataloader))
    step_losses, evaluations = {}, []
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        total_loss = 0
        if epoch == starting_epoch and skip_batches:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, skip_batches)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                step_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
                step_losses[completed_steps] = step_loss
                if args.with_tracking:
                    accelerator.log({"step_loss": step_loss, "lr": lr_scheduler.get_last_lr()[0]}, step=completed_steps)
                if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= max_train_steps:
                break
        eval_loss, perplexity = evaluate(model, eval_dataloader, accelerator, args.per_device_eval_batch_size)
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        evaluations.append({"epoch": epoch, "step": completed_steps, "eval_loss": eval_loss, "perplexity": perplexity})
        if args.with_tracking:
            accelerator.log(
                {
                    "perplexity": perplexity,
                    "eval_loss": eval_loss,
                    "train_loss": total_loss.item() / len(train_dataloader),
                    "epoch": epoch,
                },
                step=completed_steps,
            )
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        results = {
            "step_losses": step_losses,
            "evaluations": evaluations,
            "perplexity": perplexity,
            "accelerate": type(accelerator).__module__,
        }
        pathlib.Path(args.output_dir, "results.json").write_text(json.dumps(results, indent=1))
    accelerator.end_training()  # last: it also ends the process group


if __name__ == "__main__":
    main()
