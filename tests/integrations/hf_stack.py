"""What the integration tests share: a tiny corpus, a tokenizer trained on it, data files, and one job run on 2 CPU
processes either under HF Accelerate itself (`torchrun`, `ACCELERATE_USE_CPU=1`) or under accel standing in for it
(`accel launch --cpu --as_accelerate`). Everything is offline: no Hub, no network; the children are told so."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys

import torch
from safetensors.torch import load_file

JOBS = pathlib.Path(__file__).parent / "jobs"
LIBRARIES = ("hf", "accel")
JOB_TIMEOUT_S = 240
WORDS = (
    "the a one this that cat dog bird fish fox owl sees likes eats finds chases follows red blue small big old "
    "quick lazy tree river hill house field garden and but then"
).split()
# Variables of the parent that would change what a child does: the alias switch, a launcher's or another job's
# rank variables, and accel's own settings (a test's ACCEL_DISABLE_NATIVE, for instance).
_DROPPED = (
    "ACCEL_",
    "ACCELERATE_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "OMP_NUM_THREADS",
    "PYTEST_",
)


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(count)]


def build_tokenizer(folder: pathlib.Path) -> pathlib.Path:
    """A word-level tokenizer trained on the corpus's words, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "[CLS]", "[SEP]"]
    tokenizer.train_from_iterator([" ".join(WORDS)] * 2, trainers.WordLevelTrainer(special_tokens=special))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A [EOS]",
        pair="$A [SEP] $B:1 [EOS]:1",
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in ("[EOS]", "[SEP]")],
    )
    names = dict(
        pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]", cls_token="[CLS]", sep_token="[SEP]"
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)
    path = folder / "tokenizer"
    wrapped.save_pretrained(path)
    return path


def write_data(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Local data files: text for causal LM (txt and jsonl), and a sentence-pair classification task (csv): is
    there a cat in the first sentence or a dog in the second."""
    paths = {}
    for split, seed, count in (("train", 1, 96), ("validation", 2, 24)):
        lines = sentences(count, seed)
        paths[f"{split}_txt"] = folder / f"{split}.txt"
        paths[f"{split}_txt"].write_text("\n".join(lines) + "\n")
        paths[f"{split}_jsonl"] = folder / f"{split}.jsonl"
        paths[f"{split}_jsonl"].write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
        rng = random.Random(seed + 10)
        rows = ["sentence1,sentence2,label"]
        for first in lines:
            second = rng.choice(lines)
            rows.append(f"{first},{second},{int('cat' in first.split() or 'dog' in second.split())}")
        paths[f"{split}_csv"] = folder / f"{split}.csv"
        paths[f"{split}_csv"].write_text("\n".join(rows) + "\n")
    return paths


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(library: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED)}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        MASTER_ADDR="127.0.0.1",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(pathlib.Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])
        ),
    )
    if library == "hf":
        env["ACCELERATE_USE_CPU"] = "1"
    for name in ("ACCEL_DISABLE_NATIVE", "ACCEL_TRANSPORT"):  # the mode the suite runs in reaches accel's ranks
        if library == "accel" and name in os.environ:
            env[name] = os.environ[name]
    return env


def command(library: str, script: pathlib.Path, args: list[str]) -> list[str]:
    port = str(_free_port())
    if library == "hf":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            str(script),
            *args,
        ]
    return [
        sys.executable,
        "-m",
        "accel",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
        "--as_accelerate",
        str(script),
        *args,
    ]


def run_job(
    library: str, job: str, args: list[str], cwd: pathlib.Path, timeout: float = JOB_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Runs jobs/`job`.py on 2 CPU processes under `library` ("hf" or "accel"), in `cwd` (its caches go there
    too); fails the test, with the job's output, when it fails or outlives `timeout` seconds."""
    assert library in LIBRARIES, library
    env = dict(child_env(library), HF_HOME=str(cwd / "hf_home"))
    # A session of its own: a job past its deadline is ended with all its ranks (torchrun's workers outlive it).
    with subprocess.Popen(
        command(library, JOBS / f"{job}.py", args),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise AssertionError(f"{job} under {library} ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert done.returncode == 0, f"{job} under {library} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def weights(path: pathlib.Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
