"""transformers' Trainer with `TrainingArguments(deepspeed=...)` (ZeRO stage given), or without it, on CPU processes:
a tiny GPT-2 trained 6 steps; writes the log history and the strategy the Accelerator ran to --result (JSON).

    accel launch --cpu --num_processes 2 --as_accelerate trainer_deepspeed.py --stage 2 --result r.json
"""

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        tokens = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=None, help="ZeRO stage (none: no DeepSpeed)")
    parser.add_argument("--result", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32))
    deepspeed = None
    if args.stage is not None:  # HF's "auto" values, filled by the Trainer and the Accelerator
        deepspeed = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": args.stage},
        }
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        deepspeed=deepspeed,
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "distributed_type": str(trainer.accelerator.distributed_type),
                    "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
                },
                f,
            )


if __name__ == "__main__":
    main()
