"""One transformers `Trainer` job on a tiny GPT-2 built from a config: plain (`lm`), PEFT LoRA (`lora`) or TRL's
`SFTTrainer` (`sft`). It imports `accelerate` only through transformers / TRL / PEFT, so the same file runs under
HF Accelerate and under accel standing in for it. Rank 0 writes what the tests compare: the Trainer's log history
and the final weights. Several jobs run in one launch (see `main`), so the tests pay for starting 2 processes once.
"""

import argparse
import json
import pathlib

import torch
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

BLOCK = 16


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["lm", "lora", "sft"], required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--train", required=True, help="jsonl with a `text` field per line")
    parser.add_argument("--validation", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--resume_from_checkpoint", default=None)
    return parser.parse_args(argv)


def texts(path):
    return [json.loads(line)["text"] for line in pathlib.Path(path).read_text().splitlines()]


def blocks(tokenizer, path):
    """run_clm's packing: every text tokenized, concatenated and cut into BLOCK-token examples."""
    ids = [token for text in texts(path) for token in tokenizer(text)["input_ids"]]
    examples = []
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        chunk = torch.tensor(ids[start : start + BLOCK])
        examples.append({"input_ids": chunk, "attention_mask": torch.ones_like(chunk), "labels": chunk.clone()})
    return examples


def tiny_gpt2(tokenizer):
    set_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def training_args(args, config_class=TrainingArguments, **extra):
    return config_class(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        bf16=args.bf16,
        use_cpu=True,
        seed=0,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def build_trainer(args, tokenizer):
    model = tiny_gpt2(tokenizer)
    if args.task == "sft":
        from datasets import load_dataset
        from trl import SFTConfig, SFTTrainer

        data = load_dataset("json", data_files={"train": args.train, "validation": args.validation})
        config = training_args(args, SFTConfig, max_length=BLOCK, dataset_text_field="text")
        return SFTTrainer(
            model=model,
            args=config,
            train_dataset=data["train"],
            eval_dataset=data["validation"],
            processing_class=tokenizer,
        )
    if args.task == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, task_type="CAUSAL_LM")
        )
    return Trainer(
        model=model,
        args=training_args(args),
        train_dataset=blocks(tokenizer, args.train),
        eval_dataset=blocks(tokenizer, args.validation),
        data_collator=default_data_collator,
    )


def run(args):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    trainer = build_trainer(args, tokenizer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        state = {name: tensor.detach().cpu().clone().contiguous() for name, tensor in model.state_dict().items()}
        save_file(state, str(pathlib.Path(args.output_dir) / "final.safetensors"))
        result = {
            "log_history": trainer.state.log_history,
            "eval": metrics,
            "global_step": trainer.state.global_step,
            "accelerate": type(trainer.accelerator).__module__,
        }
        pathlib.Path(args.result).write_text(json.dumps(result, indent=1))
    trainer.accelerator.wait_for_everyone()


def main():
    """Runs each job of the JSON list (one argument list per job) in this process, one after another, as a
    hyper-parameter sweep would: each `Trainer` sets the shared Accelerate state up anew."""
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", help="JSON file: a list of argument lists")
    for argv in json.loads(pathlib.Path(parser.parse_args().jobs).read_text()):
        run(parse_args(argv))


if __name__ == "__main__":
    main()
