"""Sentence-pair classification without `Trainer`, on the Accelerate API directly: the paths transformers'
`run_glue_no_trainer.py` example takes (accel's own script, written for these tests). A tiny BERT built from a
config, a local tokenizer and local csv files (`sentence1`, `sentence2`, `label`); padding per batch;
`--checkpointing_steps` saves `step_N` / `epoch_N` folders with `save_state`, `--resume_from_checkpoint` loads one
and skips the batches already seen, `--with_tracking` logs to TensorBoard, and the accuracy is computed on
predictions gathered with `gather_for_metrics` (the last batch's duplicates dropped).

It imports `accelerate`, so it runs under HF Accelerate or under accel standing in for it. Besides the tracker,
rank 0 writes `results.json` (each optimizer step's loss, each epoch's accuracy) for the tests to compare.
"""

import argparse
import json
import math
import os
import pathlib

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    get_scheduler,
)

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_length", type=int, default=32)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpointing_steps", default=None, help="N (every N optimizer steps) or 'epoch'")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", default="tensorboard")
    return parser.parse_args()


def load_pairs(args, tokenizer, accelerator):
    raw = load_dataset("csv", data_files={"train": args.train_file, "validation": args.validation_file})

    def preprocess(examples):
        result = tokenizer(examples["sentence1"], examples["sentence2"], max_length=args.max_length, truncation=True)
        result["labels"] = examples["label"]
        return result

    with accelerator.main_process_first():
        return raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)


def steps_per_update(dataloader, args):
    return math.ceil(len(dataloader) / args.gradient_accumulation_steps)


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


def accuracy(model, eval_dataloader, accelerator):
    model.eval()
    correct = total = 0
    for batch in eval_dataloader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += (predictions == references).sum().item()
        total += references.numel()
    return correct / total, total


def main():
    args = parse_args()
    tracking = {"log_with": args.report_to, "project_dir": args.output_dir} if args.with_tracking else {}
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **tracking)
    set_seed(args.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_name)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertForSequenceClassification(config)
    data = load_pairs(args, tokenizer, accelerator)
    collator = DataCollatorWithPadding(tokenizer)
    train_dataloader = DataLoader(
        data["train"], shuffle=True, collate_fn=collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(data["validation"], collate_fn=collator, batch_size=args.per_device_eval_batch_size)
    no_decay = ["bias", "LayerNorm.weight"]
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
        accelerator.init_trackers("glue_no_trainer", {k: v for k, v in vars(args).items() if v is not None})
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
                step_losses[completed_steps] = accelerator.reduce(loss.detach(), reduction="mean").item()
                if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= max_train_steps:
                break
        eval_accuracy, eval_count = accuracy(model, eval_dataloader, accelerator)
        logger.info(f"epoch {epoch}: accuracy {eval_accuracy} on {eval_count} examples")
        evaluations.append({"epoch": epoch, "step": completed_steps, "accuracy": eval_accuracy, "count": eval_count})
        if args.with_tracking:
            accelerator.log(
                {"accuracy": eval_accuracy, "train_loss": total_loss.item() / len(train_dataloader), "epoch": epoch},
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
        results = {"step_losses": step_losses, "evaluations": evaluations, "accelerate": type(accelerator).__module__}
        pathlib.Path(args.output_dir, "results.json").write_text(json.dumps(results, indent=1))
    accelerator.end_training()  # last: it also ends the process group


if __name__ == "__main__":
    main()
