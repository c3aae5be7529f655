"""`accel config`: the questionnaire that writes the config file, `accel config default` and `accel config update`
(HF's: load a file, upgrade keys of older versions, write it back with every current key).

The questions, their texts, defaults and order follow HF Accelerate's `accelerate config` for the paths accel
runs: this machine, no distributed training / multi-CPU / multi-GPU, DeepSpeed, FSDP. Answers are read line by
line from stdin (no arrow-key menu), so answers can be piped in. An option question takes the option's number or
its name (case-insensitive); a yes/no question takes y/yes/n/no/true/false/1/0; an empty answer takes the default
in brackets; an invalid answer is asked again with the allowed values. stdin closing before the last answer exits
with status 1 and saves nothing.

Deliberate differences from HF Accelerate:

- FSDP is asked about on multi-GPU, as in HF, and offered on CPUs too, as a fourth machine type, "multi-CPU with
  FSDP" (then the same FSDP questions follow): a question added to the multi-CPU path would shift every piped
  answer after it (HF's multi-CPU answers, the seed's). An FSDP1 answer FSDP2 cannot honour (backward prefetch
  BACKWARD_POST / NO_PREFETCH, forward prefetch, LOCAL_STATE_DICT: accel runs FSDP1 options on FSDP2) gets the
  reason and the question again. As in HF, FSDP on GPUs does not ask for GPU ids.
- DeepSpeed is asked about where HF asks (no distributed training, CPU-only included, and multi-GPU), with HF's
  questions and YAML. Its multi-node launcher question (several machines) takes only `standard`, which is its
  default here (HF's: pdsh): accel starts every machine through torch.distributed.run, so another answer gets the
  reason and the question again, and pdsh's hostfile and filter questions never come. A DeepSpeed config file
  path must be given once asked for (HF takes an empty answer as the path "none").
- The parallelism config is asked about after FSDP2's questions, as in HF; its tensor and context parallelism
  sizes are asked until they are 1 (accel runs data parallelism only), so HF's context-parallel strategy question
  never comes.
- Not asked, because accel does not run them: Megatron-LM, TPU and the other device families, mpirun (accel
  launches through torch.distributed.run) and the FP8 backend questions (`fp8` may be chosen; `fp8_config` stays
  empty). Not asked either: NUMA affinity (`enable_cpu_affinity` is written as false;
  set the key or pass `accel launch --enable_cpu_affinity`). Amazon SageMaker is listed, as in HF, but answered
  with a message and the question again.
- Asked as HF Accelerate 0.2x did: "use IPEX?" on CPU runs, written as `ipex_config: {ipex: true}` only when
  the answer is yes (current HF Accelerate refuses the key, so a "no" is left out).
- The machine rank and the rendezvous backend are checked against the allowed values (HF takes any text).
- The number of processes (a total over all machines) must be a multiple of the number of machines, since
  every machine starts the same number; multi-GPU on one machine asks for 2 GPUs or more and offers 2 as
  the default (HF offers 1 and then stops with an error).
- `accel config default` does not replace an existing file unless `--force` is given; without it, it says so
  and exits with status 0, as HF Accelerate does.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from accel.backends import fsdp_options
from accel.cli import deepspeed_options, parallelism_options
from accel.cli.basic_config import basic_config
from accel.cli.config_file import (
    ClusterConfig,
    ConfigError,
    default_config_path,
    find_config_file,
    load_config,
    save_config,
)
from accel.env_vars import MIXED_PRECISIONS

Option = tuple[str, Any]  # (what the user sees, what the config stores)

COMPUTE_ENVIRONMENT_OPTIONS: list[Option] = [
    ("This machine", "LOCAL_MACHINE"),
    ("AWS (Amazon SageMaker)", "AMAZON_SAGEMAKER"),
]
CPU_FSDP = "MULTI_CPU_FSDP"  # accel's machine type: MULTI_CPU processes sharding with FSDP
MACHINE_TYPE_OPTIONS: list[Option] = [
    ("No distributed training", "NO"),
    ("multi-CPU", "MULTI_CPU"),
    ("multi-GPU", "MULTI_GPU"),
    ("multi-CPU with FSDP", CPU_FSDP),
]
# The backends HF Accelerate's questionnaire offers, in its order (inductor, index 2, is the default).
DYNAMO_BACKEND_OPTIONS: list[Option] = [
    (name.lower(), name)
    for name in (
        "EAGER",
        "AOT_EAGER",
        "INDUCTOR",
        "AOT_TS_NVFUSER",
        "NVPRIMS_NVFUSER",
        "CUDAGRAPHS",
        "OFI",
        "FX2TRT",
        "ONNXRT",
        "TENSORRT",
        "AOT_TORCHXLA_TRACE_ONCE",
        "TORCHXLA_TRACE_ONCE",
        "TVM",
    )
]
DYNAMO_MODE_OPTIONS: list[Option] = [(mode, mode) for mode in ("default", "reduce-overhead", "max-autotune")]
RDZV_BACKEND_OPTIONS: list[Option] = [(name, name) for name in ("static", "c10d", "etcd", "etcd-v2")]
MIXED_PRECISION_OPTIONS: list[Option] = [(name, name) for name in MIXED_PRECISIONS]


def _named_options(names: Sequence[str]) -> list[Option]:
    return [(name, name) for name in names]


SHARDING_STRATEGY_OPTIONS = _named_options(fsdp_options.SHARDING_STRATEGIES)
AUTO_WRAP_POLICY_OPTIONS = _named_options(fsdp_options.AUTO_WRAP_POLICIES)
BACKWARD_PREFETCH_OPTIONS = _named_options(fsdp_options.BACKWARD_PREFETCHES)
STATE_DICT_TYPE_OPTIONS = {
    1: _named_options(fsdp_options.STATE_DICT_TYPES),
    2: _named_options(fsdp_options.FSDP2_STATE_DICT_TYPES),
}
ZERO_STAGE_OPTIONS: list[Option] = [(str(stage), stage) for stage in deepspeed_options.ZERO_STAGES]
OFFLOAD_DEVICE_OPTIONS = _named_options(deepspeed_options.OFFLOAD_DEVICES)
MULTINODE_LAUNCHER_OPTIONS = _named_options(deepspeed_options.MULTINODE_LAUNCHERS)

_YES = ("y", "yes", "true", "1")
_NO = ("n", "no", "false", "0")
_REQUIRED = object()


class StdinClosed(Exception):
    """stdin ended before the question `question` was answered."""

    def __init__(self, question: str):
        super().__init__(question)
        self.question = question


# --- reading answers ------------------------------------------------------------------------------------


def _read_answer(prompt: str, question: str) -> str:
    try:
        answer = input(prompt)
    except EOFError:
        raise StdinClosed(question) from None
    if not sys.stdin.isatty():
        # Piped answers are not echoed by a terminal; print them so the transcript reads like a session.
        print(answer)
    return answer.strip()


def ask(prompt: str, parse: Callable[[str], Any], default: Any = _REQUIRED, question: str | None = None) -> Any:
    """Ask until `parse` accepts the answer; an empty answer gives `default` when there is one.

    Args:
        prompt: the text shown before the cursor.
        parse: turns the answer into a value; raises ValueError with a message listing what is allowed.
        default: the value of an empty answer; without one an answer is required.
        question: the question named if stdin closes (defaults to `prompt`).

    Returns:
        The parsed answer.

    Raises:
        StdinClosed: stdin ended first.
    """
    while True:
        answer = _read_answer(prompt, question or prompt.strip())
        if not answer and default is not _REQUIRED:
            return default
        try:
            return parse(answer)
        except ValueError as error:
            print(error)


def ask_yes_no(prompt: str, default: bool) -> bool:
    """Ask a yes/no question; `prompt` shows the default in capitals, as in `[yes/NO]`."""
    return ask(prompt, parse_yes_no, default)


def ask_option(question: str, options: Sequence[Option], default: int = 0) -> Any:
    """Print `options` numbered from 0 and return the stored value of the one chosen by number or name."""
    print(question)
    for index, (label, _) in enumerate(options):
        print(f"  {index}: {label}")
    prompt = f"Enter a number or a name [{default}: {options[default][0]}]: "
    return ask(prompt, lambda answer: pick_option(answer, options), options[default][1], question)


def parse_yes_no(answer: str) -> bool:
    """y/yes/true/1 → True, n/no/false/0 → False (any case); anything else raises ValueError."""
    lowered = answer.lower()
    if lowered in _YES or lowered in _NO:
        return lowered in _YES
    raise ValueError(f"{answer!r} is not a yes/no answer; allowed: {', '.join(_YES + _NO)}.")


def pick_option(answer: str, options: Sequence[Option]) -> Any:
    """The stored value of the option named by `answer`: its number, its label or its stored value."""
    if answer.isascii() and answer.isdigit() and int(answer) < len(options):
        return options[int(answer)][1]
    for label, value in options:
        if answer.casefold() in (label.casefold(), str(value).casefold()):
            return value
    labels = ", ".join(f"{index} ({label})" for index, (label, _) in enumerate(options))
    raise ValueError(f"{answer!r} is not one of the options; allowed: {labels}.")


def integer_between(low: int, high: int | None = None, hint: str = "", multiple_of: int = 1) -> Callable[[str], int]:
    """A parser accepting the multiples of `multiple_of` in [low, high] (no upper bound when `high` is None)."""
    allowed = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
    if multiple_of > 1:
        allowed += f" that is a multiple of {multiple_of}"

    def parse(answer: str) -> int:
        value = int(answer) if re.fullmatch(r"[+-]?\d+", answer) else None
        if value is None or value < low or (high is not None and value > high) or value % multiple_of:
            raise ValueError(f"{answer!r} is not valid; allowed: {allowed}.{hint}")
        return value

    return parse


def number_at_least(low: float) -> Callable[[str], float]:
    """A parser accepting numbers >= `low`."""

    def parse(answer: str) -> float:
        try:
            value = float(answer)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise ValueError(f"{answer!r} is not valid; allowed: a number >= {low}.")
        return value

    return parse


def required_text(answer: str) -> str:
    """Any non-empty answer."""
    if not answer:
        raise ValueError("An answer is required.")
    return answer


def gpu_id_list(answer: str) -> str:
    """'all' or a comma-separated list of device ids."""
    if answer.lower() == "all" or re.fullmatch(r"\d+(\s*,\s*\d+)*", answer):
        return answer
    raise ValueError(f"{answer!r} is not valid; allowed: 'all' or device ids separated by commas, such as 0,1.")


# --- the questions --------------------------------------------------------------------------------------


def ask_compute_environment() -> str:
    """Where training runs; only this machine is supported, SageMaker gets a message and the question again."""
    while True:
        environment = ask_option("In which compute environment are you running?", COMPUTE_ENVIRONMENT_OPTIONS)
        if environment == "LOCAL_MACHINE":
            return environment
        print("Amazon SageMaker is not supported by accel yet; choose 'This machine'.")


def ask_machines() -> dict[str, Any]:
    """How many machines, and for several: this one's rank, the main process's address, the network."""
    num_machines = ask(
        "How many different machines will you use (use more than 1 for multi-node training)? [1]: ",
        integer_between(1),
        default=1,
    )
    if num_machines == 1:
        return {"num_machines": 1}
    return {
        "num_machines": num_machines,
        "machine_rank": ask("What is the rank of this machine? [0]: ", integer_between(0, num_machines - 1), 0),
        "main_process_ip": ask(
            "What is the IP address of the machine that will host the main process? ", required_text
        ),
        "main_process_port": ask(
            "What is the port you will use to communicate with the main process? ", integer_between(1, 65535)
        ),
        **ask_network(),
    }


def ask_network() -> dict[str, Any]:
    """Whether the machines share a local network; if not, which rendezvous backend joins them."""
    same_network = ask_yes_no(
        "Are all the machines on the same local network? Answer `no` if nodes are on the cloud and/or on "
        "different network hosts [YES/no]: ",
        default=True,
    )
    if same_network:
        return {"same_network": True}
    backend = ask_option("What rendezvous backend will you use?", RDZV_BACKEND_OPTIONS)
    return {"same_network": False, "rdzv_backend": backend}


def ask_debug() -> bool:
    """Whether collectives are checked across ranks (slower, turns hangs into errors)."""
    return ask_yes_no(
        "Should distributed operations be checked while running for errors? This can avoid timeout issues but "
        "will be slower. [yes/NO]: ",
        default=False,
    )


def ask_cpu_only() -> bool:
    """Whether a non-distributed run stays on the CPU even when an accelerator is present."""
    return ask_yes_no(
        "Do you want to run your training on CPU only (even if a GPU / Apple Silicon / Ascend NPU device is "
        "available)? [yes/NO]:",
        default=False,
    )


def ask_ipex() -> dict[str, bool]:
    """Whether CPU training uses Intel Extension for PyTorch, as HF Accelerate 0.2x asked."""
    use_ipex = ask_yes_no(
        "Do you want to use Intel PyTorch Extension (IPEX) to speed up training on CPU? [yes/NO]:", default=False
    )
    return {"ipex": use_ipex}


def ask_dynamo() -> dict[str, Any]:
    """torch.compile settings; an empty dict (nothing written) when dynamo is not wanted."""
    if not ask_yes_no("Do you wish to optimize your script with torch dynamo?[yes/NO]:", default=False):
        return {}
    config = {"dynamo_backend": ask_option("Which dynamo backend would you like to use?", DYNAMO_BACKEND_OPTIONS, 2)}
    if ask_yes_no("Do you want to customize the defaults sent to torch.compile? [yes/NO]: ", default=False):
        config["dynamo_mode"] = ask_option("Which mode do you want to use?", DYNAMO_MODE_OPTIONS)
        config["dynamo_use_fullgraph"] = ask_yes_no(
            "Do you want the fullgraph mode or it is ok to break model into several subgraphs? [yes/NO]: ",
            default=False,
        )
        config["dynamo_use_dynamic"] = ask_yes_no(
            "Do you want to enable dynamic shape tracing? [yes/NO]: ", default=False
        )
        config["dynamo_use_regional_compilation"] = ask_yes_no(
            "Do you want to enable regional compilation? [yes/NO]: ", default=False
        )
    return config


def ask_fsdp2_runnable(key: str, ask_value: Callable[[], Any]) -> Any:
    """Ask (with `ask_value`) until the answer for FSDP option `key` is one FSDP2 can honour."""
    while True:
        value = ask_value()
        refusal = fsdp_options.fsdp2_refusal(key, value)
        if refusal is None:
            return value
        print(f"{key.removeprefix('fsdp_')} {fsdp_options.shown(value)} is not supported by accel: {refusal}")


def ask_fsdp_wrapping() -> dict[str, Any]:
    """The auto wrap policy, and its layer classes or minimum size."""
    config = {"fsdp_auto_wrap_policy": ask_option("What should be your auto wrap policy?", AUTO_WRAP_POLICY_OPTIONS)}
    if config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":
        no_split_modules = ask_yes_no(
            "Do you want to use the model's `_no_split_modules` to wrap. Only applicable for 🤗 Transformers "
            "[yes/NO]: ",
            default=False,
        )
        if not no_split_modules:
            config["fsdp_transformer_layer_cls_to_wrap"] = ask(
                "Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap ,e.g, :"
                "`BertLayer`, `GPTJBlock`, `T5Block`, `BertLayer,BertEmbeddings,BertSelfOutput` ...? : ",
                required_text,
            )
    elif config["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP":
        config["fsdp_min_num_params"] = ask(
            "What should be your FSDP's minimum number of parameters for Default Auto Wrapping Policy? [1e8]: ",
            integer_between(0),
            default=100000000,
        )
    return config


def ask_fsdp_sharding(version: int) -> dict[str, Any]:
    """Resharding after forward: FSDP1's sharding strategy (HF stores it under this key) or FSDP2's yes/no."""
    if version == 1:
        reshard = ask_option("What should be your sharding strategy?", SHARDING_STRATEGY_OPTIONS)
    else:
        reshard = ask_yes_no("Do you want to enable resharding after forward? [YES/no]: ", default=True)
    return {"fsdp_reshard_after_forward": reshard}


def ask_fsdp1_prefetching() -> dict[str, Any]:
    """FSDP1's backward prefetch policy (asked before the state dict type, as HF does)."""
    backward = ask_fsdp2_runnable(
        "fsdp_backward_prefetch",
        lambda: ask_option("What should be your FSDP's backward prefetch policy?", BACKWARD_PREFETCH_OPTIONS),
    )
    return {"fsdp_backward_prefetch": backward}


def ask_fsdp1_parameters() -> dict[str, Any]:
    """FSDP1's forward prefetch and use_orig_params (asked after the state dict type, as HF does)."""
    forward = ask_fsdp2_runnable(
        "fsdp_forward_prefetch",
        lambda: ask_yes_no("Do you want to enable FSDP's forward prefetch policy? [yes/NO]: ", default=False),
    )
    use_orig_params = ask_yes_no("Do you want to enable FSDP's `use_orig_params` feature? [YES/no]: ", default=True)
    return {"fsdp_forward_prefetch": forward, "fsdp_use_orig_params": use_orig_params}


def ask_fsdp_loading(version: int) -> dict[str, Any]:
    """RAM-efficient loading and, for FSDP1, whether rank 0's module states are broadcast (implied by the first)."""
    config = {
        "fsdp_cpu_ram_efficient_loading": ask_yes_no(
            "Do you want to enable CPU RAM efficient model loading? Only applicable for 🤗 Transformers models. "
            "[YES/no]: ",
            default=True,
        )
    }
    if version == 1:
        config["fsdp_sync_module_states"] = config["fsdp_cpu_ram_efficient_loading"] or ask_yes_no(
            "Do you want each individually wrapped FSDP unit to broadcast module parameters from rank 0 at the "
            "start? [YES/no]: ",
            default=True,
        )
    return config


def ask_fsdp(chosen: bool = False) -> dict[str, Any]:
    """HF's FSDP questions, in its order; an empty dict (no FSDP) when FSDP is not wanted (not asked when `chosen`
    already)."""
    if not chosen and not ask_yes_no("Do you want to use FullyShardedDataParallel? [yes/NO]: ", default=False):
        return {}
    version = ask("What should be your FSDP version? [2]: ", integer_between(1, 2), default=2)
    config = {"fsdp_version": version, **ask_fsdp_sharding(version)}
    config["fsdp_offload_params"] = ask_yes_no(
        "Do you want to offload parameters and gradients to CPU? [yes/NO]: ", default=False
    )
    config.update(ask_fsdp_wrapping())
    if version == 1:
        config.update(ask_fsdp1_prefetching())
    config["fsdp_state_dict_type"] = ask_fsdp2_runnable(
        "fsdp_state_dict_type",
        lambda: ask_option("What should be your FSDP's state dict type?", STATE_DICT_TYPE_OPTIONS[version]),
    )
    if version == 1:
        config.update(ask_fsdp1_parameters())
    config.update(ask_fsdp_loading(version))
    config["fsdp_activation_checkpointing"] = ask_yes_no(
        "Do you want to enable FSDP activation checkpointing? [yes/NO]: ", default=False
    )
    return config


def ask_data_parallel_only(prompt: str, feature: str) -> int:
    """Ask (HF's `prompt`, default 1) until the size is 1: accel does not run `feature`."""
    while True:
        size = ask(prompt, integer_between(1), default=1)
        if size == 1:
            return size
        print(f"{feature} size {size} is not supported by accel: accel runs data parallelism only; answer 1.")


def ask_parallelism() -> dict[str, int]:
    """HF's parallelism-config questions (asked after FSDP2's), in its order, as `parallelism_config` keys; an
    empty dict when it is not wanted. Tensor and context parallelism sizes are asked until they are 1, so HF's
    question on the context-parallel strategy (asked with cp_size > 1) never comes."""
    if not ask_yes_no("Do you want to use the parallelism config? [yes/NO]: ", default=False):
        return {}
    prefix = parallelism_options.PREFIX
    return {
        prefix + "dp_replicate_size": ask(
            "What is the data parallelism replicate size? [1]: ", integer_between(1), default=1
        ),
        prefix + "dp_shard_size": ask("What is the FSDP shard size? [1]: ", integer_between(1), default=1),
        prefix + "tp_size": ask_data_parallel_only("What is the tensor parallelism size? [1]: ", "tensor parallelism"),
        prefix + "cp_size": ask_data_parallel_only(
            "What is the context parallelism size? [1]: ", "context parallelism"
        ),
    }


def ask_deepspeed_offload() -> dict[str, str]:
    """Where ZeRO 2 and 3 offload optimizer states and parameters, and the NVMe paths when offloaded there."""
    config = {
        "offload_optimizer_device": ask_option("Where to offload optimizer states?", OFFLOAD_DEVICE_OPTIONS),
        "offload_param_device": ask_option("Where to offload parameters?", OFFLOAD_DEVICE_OPTIONS),
    }
    if config["offload_param_device"] == "nvme":
        config["offload_param_nvme_path"] = ask("Nvme Path to offload parameters? [/nvme]: ", required_text, "/nvme")
    if config["offload_optimizer_device"] == "nvme":
        config["offload_optimizer_nvme_path"] = ask(
            "Nvme Path to offload optimizer states? [/nvme]: ", required_text, "/nvme"
        )
    return config


def ask_deepspeed_settings() -> dict[str, Any]:
    """The settings of a DeepSpeed config built without a JSON file: ZeRO stage, offloading, gradient accumulation
    and clipping, and 16-bit saving under ZeRO-3."""
    stage = ask_option("What should be your DeepSpeed's ZeRO optimization stage?", ZERO_STAGE_OPTIONS, default=2)
    config: dict[str, Any] = {"zero_stage": stage}
    if config["zero_stage"] >= 2:
        config.update(ask_deepspeed_offload())
    config["gradient_accumulation_steps"] = ask(
        "How many gradient accumulation steps you're passing in your script? [1]: ", integer_between(1), default=1
    )
    if ask_yes_no("Do you want to use gradient clipping? [yes/NO]: ", default=False):
        config["gradient_clipping"] = ask("What is the gradient clipping value? [1.0]: ", number_at_least(0), 1.0)
    if config["zero_stage"] == 3:
        config["zero3_save_16bit_model"] = ask_yes_no(
            "Do you want to save 16-bit model weights when using ZeRO Stage-3? [yes/NO]: ", default=False
        )
    return config


def ask_multinode_launcher() -> str:
    """HF's launcher question, asked until the answer is `standard`, the only start accel does."""
    while True:
        launcher = ask_option("Which Type of launcher do you want to use?", MULTINODE_LAUNCHER_OPTIONS, default=1)
        if launcher == deepspeed_options.STANDARD_LAUNCHER:
            return launcher
        print(
            f"{launcher} is not supported by accel: accel starts every machine through torch.distributed.run; "
            "choose standard and run `accel launch` on each machine."
        )


def ask_deepspeed(num_machines: int) -> dict[str, Any]:
    """HF's DeepSpeed questions, in its order; an empty dict (no DeepSpeed) when DeepSpeed is not wanted."""
    if not ask_yes_no("Do you want to use DeepSpeed? [yes/NO]: ", default=False):
        return {}
    if ask_yes_no("Do you want to specify a json file to a DeepSpeed config? [yes/NO]: ", default=False):
        config = {
            "deepspeed_config_file": ask("Please enter the path to the json DeepSpeed config file: ", required_text)
        }
    else:
        config = ask_deepspeed_settings()
    config["zero3_init_flag"] = ask_yes_no(
        "Do you want to enable `deepspeed.zero.Init` when using ZeRO Stage-3 for constructing massive models? "
        "[yes/NO]: ",
        default=False,
    )
    if ask_yes_no("Do you want to enable Mixture-of-Experts training (MoE)? [yes/NO]: ", default=False):
        config["deepspeed_moe_layer_cls_names"] = ask(
            "Specify the comma-separated list of transformers MoE layer class names (case-sensitive), e.g :  "
            "`MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`, `JetMoEAttention,JetMoEBlock` ... : ",
            required_text,
        )
    if num_machines > 1:
        config["deepspeed_multinode_launcher"] = ask_multinode_launcher()
    return config


def ask_num_processes(distributed_type: str, num_machines: int) -> int:
    """How many processes (multi-CPU) or GPUs (multi-GPU, DeepSpeed) in total, the same number on every machine."""
    device = "processes" if distributed_type == "MULTI_CPU" else "GPU(s)"
    if num_machines > 1 or distributed_type in ("MULTI_CPU", "DEEPSPEED"):
        # The launcher starts num_processes / num_machines processes on each machine.
        question = f"How many {device} should be used for distributed training? [{num_machines}]:"
        return ask(question, integer_between(num_machines, multiple_of=num_machines), num_machines)
    # HF offers 1 here and then refuses it: multi-GPU on one machine means 2 GPUs or more.
    hint = " multi-GPU on one machine needs 2 GPUs or more; for one GPU choose 'No distributed training'."
    question = f"How many {device} should be used for distributed training? [2]:"
    return ask(question, integer_between(2, hint=hint), 2)


def ask_gpu_ids() -> str:
    """Which GPUs of this machine to use."""
    return ask(
        "What GPU(s) (by id) should be used for training on this machine as a comma-separated list? [all]:",
        gpu_id_list,
        default="all",
    )


def get_user_input() -> ClusterConfig:
    """Ask every question, in HF Accelerate's order, and return the resulting config (not saved)."""
    compute_environment = ask_compute_environment()
    distributed_type = ask_option("Which type of machine are you using?", MACHINE_TYPE_OPTIONS)
    cpu_fsdp = distributed_type == CPU_FSDP
    distributed_type = "MULTI_CPU" if cpu_fsdp else distributed_type
    is_distributed = distributed_type != "NO"
    # HF's questionnaire writes same_network: true for a single machine too.
    machines = {"same_network": True, **ask_machines()} if is_distributed else {"same_network": True}
    debug = ask_debug() if is_distributed else False
    use_cpu = distributed_type == "MULTI_CPU" or (distributed_type == "NO" and ask_cpu_only())
    # Only a "yes" is written: current HF Accelerate no longer knows the ipex_config key and would refuse the file.
    ipex_config = ask_ipex() if use_cpu else {}
    ipex_config = ipex_config if ipex_config.get("ipex") else {}
    dynamo_config = ask_dynamo()
    num_machines = machines.get("num_machines", 1)
    deepspeed_config = ask_deepspeed(num_machines) if distributed_type in ("NO", "MULTI_GPU") else {}
    distributed_type = "DEEPSPEED" if deepspeed_config else distributed_type
    fsdp_config = ask_fsdp(chosen=cpu_fsdp) if cpu_fsdp or distributed_type == "MULTI_GPU" else {}
    parallelism_config = ask_parallelism() if fsdp_config.get("fsdp_version") == 2 else {}
    num_processes = ask_num_processes(distributed_type, num_machines) if distributed_type != "NO" else 1
    gpu_ids = None if use_cpu or fsdp_config or deepspeed_config else ask_gpu_ids()  # as HF: none for FSDP, DeepSpeed
    # HF leaves the precision to the DeepSpeed config file when there is one (see accel/cli/launch.py).
    mixed_precision = (
        None
        if "deepspeed_config_file" in deepspeed_config
        else ask_option("Do you wish to use mixed precision?", MIXED_PRECISION_OPTIONS)
    )
    return ClusterConfig(
        compute_environment=compute_environment,
        distributed_type="FSDP" if fsdp_config else distributed_type,
        mixed_precision=mixed_precision,
        use_cpu=use_cpu,
        debug=debug,
        num_processes=num_processes,
        gpu_ids=gpu_ids,
        ipex_config=ipex_config,
        dynamo_config=dynamo_config,
        fsdp_config=fsdp_config,
        parallelism_config=parallelism_config,
        deepspeed_config=deepspeed_config,
        **machines,
    )


# --- the commands ---------------------------------------------------------------------------------------


def _target_path(config_file: str | None) -> Path:
    return Path(config_file).expanduser() if config_file else default_config_path()


def _save(config: ClusterConfig, path: Path) -> int:
    try:
        save_config(config, path)
    except ConfigError as error:
        print(f"accel config: {error}", file=sys.stderr)
        return 1
    print(f"accel configuration saved at {path}")
    return 0


def run_questionnaire(args: argparse.Namespace) -> int:
    """`accel config`: ask, then save to `--config_file` or the default path. Returns the exit status."""
    try:
        config = get_user_input()
    except StdinClosed as closed:
        print(
            f"\naccel config: stdin closed before this question was answered: {closed.question!r}. Nothing was saved.",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("\naccel config: interrupted. Nothing was saved.", file=sys.stderr)
        return 130
    return _save(config, _target_path(args.config_file))


def run_default(args: argparse.Namespace) -> int:
    """`accel config default`: write a basic config for this machine, never over an existing file without --force."""
    path = _target_path(args.config_file)
    if path.exists() and not args.force:
        print(
            f"Configuration already exists at {path}, will not override. Pass --force to replace it, "
            "--config_file to write elsewhere, or run `accel config`."
        )
        return 0
    return _save(basic_config(args.mixed_precision), path)


def run_update(args: argparse.Namespace) -> int:
    """`accel config update`: load a config file (legacy keys upgraded, every key checked) and write it back with
    every current key, in its own format (YAML, or JSON for a .json name). Without --config_file: the default
    file (accel's, else HF Accelerate's)."""
    path = Path(args.config_file).expanduser() if args.config_file else find_config_file()
    if path is None:
        raise ConfigError(
            f"no config file to update at {default_config_path()}; pass --config_file or run `accel config`"
        )
    save_config(load_config(path), path)
    print(f"Successfully updated the configuration file at {path}.")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `config` (and its `default` and `update` subcommands) to the `accel` parser."""
    parser = subparsers.add_parser(
        "config",
        help="Answer a few questions and save the config `accel launch` uses.",
        description="Answer a few questions about this machine and save them as the config `accel launch` uses.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config_file",
        "--config-file",
        default=None,
        help="Where to save the config (default: $ACCEL_CONFIG_FILE, else "
        "$XDG_CACHE_HOME/accel/default_config.yaml, else ~/.cache/accel/default_config.yaml). "
        "A name ending in .json is written as JSON.",
    )
    parser.set_defaults(run=run_questionnaire)
    commands = parser.add_subparsers(title="subcommands", metavar="{default,update}")
    _register_default(commands)
    _register_update(commands)
    return parser


def _register_update(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "update",
        help="Update a config file to the current keys, keeping its settings.",
        description="Load a config file (HF Accelerate's or accel's), upgrade keys of older versions, and write it "
        "back with every current key.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config_file",
        "--config-file",
        default=argparse.SUPPRESS,
        help="The config file to update (default: accel's default file, else HF Accelerate's).",
    )
    parser.set_defaults(run=run_update)


def _register_default(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "default",
        help="Write a basic config for this machine without asking.",
        description="Write a basic config for this machine: all its GPUs when it has several, else one process "
        "(on the CPU when it has no GPU).",
        allow_abbrev=False,
    )
    # SUPPRESS keeps a --config_file given before `default` instead of resetting it to None.
    parser.add_argument("--config_file", "--config-file", default=argparse.SUPPRESS, help="Where to save the config.")
    parser.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], default="no", help="Mixed precision to use."
    )
    parser.add_argument("--force", action="store_true", help="Replace an existing config file.")
    parser.set_defaults(run=run_default)
