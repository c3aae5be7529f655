"""The names of the files in a checkpoint folder: HF Accelerate's, so either library reads the other's folders.

Every checkpoint file name accel writes or looks for is defined here once (`accel.checkpoint` and
`accel.utils.constants` re-export these objects).
"""

from __future__ import annotations

import re

SAFE_MODEL_NAME = "model"
MODEL_NAME = "pytorch_model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
DATALOADER_STATE_NAME = "dl_state_dict"  # a stateful dataloader's state_dict() (HF's name; no constant in HF)
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
CUSTOM_CHECKPOINT_NAME = "custom_checkpoint"
FSDP_MODEL_NAME = "pytorch_model_fsdp"  # FSDP's sharded model folders: pytorch_model_fsdp_0/, ... (DCP)
# DeepSpeed's engine checkpoints: a folder per model named by its tag (`pytorch_model/`, `pytorch_model_1/`), and
# the file naming the newest tag; DeepSpeed also copies its conversion scripts (zero_to_fp32.py) beside them.
DEEPSPEED_LATEST = "latest"

SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
# HF's patterns for (sharded) weight file names: `{suffix}` is "" for one file, "-00001-of-00003" for the first
# of three shards.
SAFE_WEIGHTS_PATTERN_NAME = SAFE_MODEL_NAME + "{suffix}.safetensors"
WEIGHTS_PATTERN_NAME = MODEL_NAME + "{suffix}.bin"

# The folders of automatic checkpoint naming (`checkpoints/checkpoint_N`).
CHECKPOINT_PATTERN = re.compile(r"checkpoint_(\d+)")
# accel's record of a save_state folder's durability (hidden): "unsynced <host> <boot id>" while the folder was
# published from the page cache of that boot, "durable <host> <boot id>" once everything in it is fsync'd. Its
# content is rewritten in place, never its name. See accel.checkpoint.durability.
DURABILITY_RECORD = ".accel-durability"
# save_model's weight files and their indexes (`model-00001-of-00002.safetensors`, `pytorch_model.bin.index.json`).
WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")
# A checkpoint folder's list of renames in progress (save_model's, and save_state's into a folder that holds other
# things): after a crash, read through by a load and completed by the next save into the folder
# (accel.checkpoint.publish_journal).
PUBLISH_JOURNAL = ".accel-publish.json"
# Every file save_state writes (what a folder swap may replace; anything else there is the user's).
CHECKPOINT_FILE = re.compile(
    rf"({SAFE_MODEL_NAME}|{MODEL_NAME})(_\d+)?\.(safetensors|bin)|"
    rf"({OPTIMIZER_NAME}|{SCHEDULER_NAME}|{SAMPLER_NAME}|{DATALOADER_STATE_NAME})(_\d+)?\.bin|"
    rf"{re.escape(SCALER_NAME)}|{RNG_STATE_NAME}_\d+\.pkl|{CUSTOM_CHECKPOINT_NAME}_\d+\.pkl|"
    rf"({FSDP_MODEL_NAME}|{OPTIMIZER_NAME})_\d+|"  # FSDP's sharded state: DCP folders
    rf"{MODEL_NAME}(_\d+)?|{DEEPSPEED_LATEST}|zero_to_fp32\.py|zero_to_torch\.py|"  # DeepSpeed's checkpoint
    rf"{re.escape(DURABILITY_RECORD)}"
)


def numbered(name: str, index: int, extension: str) -> str:
    """HF's numbering of the files of several objects: `optimizer.bin`, `optimizer_1.bin`, ..."""
    return f"{name}{'' if index == 0 else f'_{index}'}{extension}"


def custom_checkpoint_name(index: int) -> str:
    """The file of the `index`-th object registered for checkpointing (numbered from 0, unlike `numbered`)."""
    return f"{CUSTOM_CHECKPOINT_NAME}_{index}.pkl"
