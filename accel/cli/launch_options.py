"""Every `accelerate launch` option as `accel launch` parses it: HF Accelerate 1.15's names (underscore and dash
spellings), short forms (`-t`, `-q`, `-m`), types, defaults and actions.

Two kinds of options:

- RUN groups: accel does what they ask; each option's dest is a LaunchConfig field (`--cpu` is `use_cpu`).
- REFUSED groups: backends accel does not run (Megatron-LM, FP8, TPU, SageMaker, mpirun). They parse, so HF
  command lines read; giving any of them is refused with one `UnsupportedFeatureError` naming the flag, before
  anything starts. (The parallelism config is a RUN group: its sizes above data parallelism are refused when the
  settings are resolved, launch.py, since a config file or a variable can ask for them too.)

HF ignores, e.g., `--zero_stage` without `--use_deepspeed`; accel refuses it, since a flag that silently does
nothing hides a mistake (likewise an `--fsdp_*` flag without FSDP and a `--parallelism_config_*` flag without
`--use_parallelism_config`, see launch.py).

Which options were given is recorded in `namespace.nondefault`, a {dest: option string as typed} dict (HF's
parser keeps a set of the same name), so an option repeating its default still counts as given, and a default
never counts as asked for. Defaults are HF's, so a namespace from this parser can be handed to HF-style code
(`prepare_simple_launcher_cmd_env(args)`).

Deliberate differences: HF's `type=bool` options (`--megatron_lm_*`,
`--parallelism_config_sp_seq_length_is_variable`) read "False" as True; here they take a boolean word.
`--mixed_precision`, `--dynamo_backend` and `--dynamo_mode` are checked when the settings are resolved rather than
by argparse's `choices`, so that values from the config file and ACCEL_* variables get the same message and
backends are matched case-insensitively.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass
from typing import Any, Callable

from accel.cli.refusals import refuse_backend
from accel.env_vars import parse_bool
from accel.unsupported import UnsupportedFeatureError


def _boolean(value: str) -> bool:
    try:
        return parse_bool(value, "value")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _booleans(value: str) -> tuple[bool, ...]:
    return tuple(_boolean(part) for part in value.split(","))


@dataclass(frozen=True)
class Option:
    """One option: `--name` (and `--na-me`), an optional short form, and argparse's type/default/action."""

    name: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    action: str = "store"  # store, store_true, store_false or append
    short: str | None = None
    dest: str | None = None
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Group:
    """A titled group of options; `backend` (a key of refusals.BACKENDS) marks a group accel refuses."""

    title: str
    options: tuple[Option, ...]
    backend: str | None = None


def _flag(name: str, help: str, **kwargs: Any) -> Option:
    return Option(name, help, action="store_true", default=False, **kwargs)


_HARDWARE = Group(
    "Hardware selection",
    (
        Option(
            "config_file", "Config file for the defaults (default: accel's, else HF Accelerate's default_config.yaml)."
        ),
        _flag(
            "quiet",
            "On failure, show only the failing ranks' own output and tracebacks, not the launcher's summary and log.",
            short="-q",
        ),
        _flag("cpu", "Run on the CPU, even when GPUs are present."),
        _flag("multi_gpu", "One process per GPU."),
        _flag("debug", "Check distributed operations for errors (slower)."),
        _flag("ipex", "Use Intel Extension for PyTorch on CPU (accel's; HF Accelerate 1.x dropped the flag)."),
    ),
)
_RESOURCES = Group(
    "Resource selection",
    (
        Option("mixed_precision", "One of no, fp16, bf16 (fp8 is refused: FP8 engines are not run)."),
        Option("num_processes", "Total number of processes over all machines.", type=int),
        Option("num_machines", "Number of machines.", type=int),
        Option("num_cpu_threads_per_process", "OMP threads per process (default: cores / processes).", type=int),
        _flag(
            "enable_cpu_affinity",
            "Pin each rank to its CPUs: those of its GPU's NUMA node, or on CPUs its own "
            "NUMA-aware share of the cores.",
        ),
        Option("dynamo_backend", "torch.compile backend (no, inductor, ...)."),
        Option("dynamo_mode", "torch.compile mode.", default="default"),
        _flag("dynamo_use_fullgraph", "torch.compile with fullgraph=True."),
        _flag("dynamo_use_dynamic", "torch.compile with dynamic=True."),
        _flag("dynamo_use_regional_compilation", "Compile repeated blocks once (regional compilation)."),
        Option(
            "gradient_accumulation_steps", "Steps to accumulate gradients over (exported to the Accelerator).", type=int
        ),
    ),
)
_DISTRIBUTED = Group(
    "Distributed processes",
    (
        Option("gpu_ids", "Comma-separated GPU ids to use on this machine."),
        _flag(
            "same_network", "All machines are on one local network (accepted; the rendezvous is the same either way)."
        ),
        Option("machine_rank", "Rank of this machine, 0 .. num_machines-1.", type=int),
        Option("main_process_ip", "Address of machine_rank 0."),
        Option("main_process_port", "Port on machine_rank 0 (default on one machine: a free port).", type=int),
        Option(
            "tee",
            "Tee the ranks' std streams into log files and the console: 0 none, 1 stdout, 2 stderr, 3 both, "
            "or per local rank as 0:1,1:2.",
            default="0",
            short="-t",
        ),
        Option("log_dir", "Folder for the ranks' log files (kept; without it they go to a temporary folder)."),
        Option("role", "User-defined role of the workers.", default="default"),
        Option("rdzv_backend", "Rendezvous backend: static (default) or c10d.", default="static"),
        Option("rdzv_conf", "More rendezvous settings: key1=value1,key2=value2.", default=""),
        Option("max_restarts", "Restarts of the worker group before failing.", type=int, default=0),
        Option("monitor_interval", "Seconds between checks of the workers' state.", type=float, default=0.1),
        _flag("module", "Run training_script as a module, like python -m.", short="-m"),
        _flag("no_python", "Run training_script as an executable, not with python."),
        Option(
            "main_training_function",
            "Call this function of the script (with no arguments) instead of running it as __main__.",
        ),
        _flag("downcast_bf16", "With bf16 on TPUs, downcast float64 to bfloat16 too (exported; only XLA reads it)."),
    ),
)

_DEEPSPEED = Group(
    "DeepSpeed",
    (
        _flag("use_deepspeed", "Train with DeepSpeed (on CPU processes too, with --cpu)."),
        Option("deepspeed_config_file", "DeepSpeed config file (JSON)."),
        Option("zero_stage", "DeepSpeed's ZeRO stage: 0, 1, 2 or 3 (default 2).", type=int),
        Option("offload_optimizer_device", "Where to offload the optimizer states: none, cpu or nvme (default none)."),
        Option("offload_param_device", "Where to offload the parameters: none, cpu or nvme (default none)."),
        Option("offload_optimizer_nvme_path", "NVMe path for offloaded optimizer states."),
        Option("offload_param_nvme_path", "NVMe path for offloaded parameters."),
        Option("gradient_clipping", "Gradient clipping value of the DeepSpeed config.", type=float),
        Option(
            "zero3_init_flag",
            "Build the model under deepspeed.zero.Init (true|false; ZeRO-3 only, where it defaults to true).",
        ),
        Option("zero3_save_16bit_model", "Save 16-bit model weights with ZeRO-3 (true|false; default false)."),
        Option(
            "deepspeed_hostfile", "pdsh's hostfile (refused with several machines: accel starts each machine itself)."
        ),
        Option("deepspeed_exclusion_filter", "pdsh's exclusion filter (refused with several machines)."),
        Option("deepspeed_inclusion_filter", "pdsh's inclusion filter (refused with several machines)."),
        Option(
            "deepspeed_multinode_launcher",
            "How the machines start: standard (accel launch on each machine; the "
            "only one accel runs with several machines), pdsh, openmpi, mvapich, mpich, nossh, slurm.",
        ),
        Option("deepspeed_moe_layer_cls_names", "Comma-separated MoE layer class names (MixtralSparseMoeBlock, ...)."),
    ),
)
_FSDP = Group(
    "FSDP",
    (
        _flag("use_fsdp", "Shard the model with FSDP (accel runs FSDP2; on CPU processes too, with --cpu)."),
        Option(
            "fsdp_version",
            "FSDP version: 2, or 1 (its options run on FSDP2, as `accel to-fsdp2` translates them).",
            default="1",
            choices=("1", "2"),
        ),
        Option("fsdp_offload_params", "Offload parameters and gradients to the CPU (true|false).", default="false"),
        Option(
            "fsdp_min_num_params", "Minimum parameters of a module for SIZE_BASED_WRAP.", type=int, default=int(1e8)
        ),
        Option(
            "fsdp_sharding_strategy",
            "FSDP1's sharding strategy: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2.",
            default="FULL_SHARD",
        ),
        Option(
            "fsdp_reshard_after_forward",
            "Reshard the parameters after forward (true|false; FSDP1: a sharding strategy).",
            default="true",
        ),
        Option("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP."),
        Option(
            "fsdp_transformer_layer_cls_to_wrap", "Comma-separated transformer layer classes to wrap (BertLayer, ...)."
        ),
        Option(
            "fsdp_backward_prefetch",
            "FSDP1's backward prefetch: BACKWARD_PRE (FSDP2 always does it), BACKWARD_POST or NO_PREFETCH.",
        ),
        Option("fsdp_state_dict_type", "FULL_STATE_DICT or SHARDED_STATE_DICT (FSDP1: also LOCAL_STATE_DICT)."),
        Option("fsdp_forward_prefetch", "FSDP1's explicit forward prefetch (true|false).", default="false"),
        Option("fsdp_use_orig_params", "FSDP1's use_orig_params (true|false; FSDP2 always uses them).", default="true"),
        Option(
            "fsdp_cpu_ram_efficient_loading",
            "Load a Transformers checkpoint on the first process only (true|false).",
            default="true",
        ),
        Option(
            "fsdp_sync_module_states", "FSDP1: broadcast the module states from rank 0 (true|false).", default="true"
        ),
        Option(
            "fsdp_activation_checkpointing",
            "Activation checkpointing of the wrapped layers (true|false).",
            default="false",
        ),
        Option(
            "fsdp_activation_checkpointing_offload",
            "Offload the checkpointed activations to the CPU (true|false; needs activation checkpointing).",
            default="false",
        ),
    ),
)
_MEGATRON = Group(
    "Megatron-LM",
    (
        _flag("use_megatron_lm", "Use Megatron-LM."),
        Option("megatron_lm_tp_degree", "Tensor parallel degree.", type=int, default=1),
        Option("megatron_lm_use_custom_fsdp", "Custom FSDP.", type=_boolean, default=False),
        Option("megatron_lm_no_load_optim", "Do not load the optimizer.", type=_boolean, default=False),
        Option("megatron_lm_eod_mask_loss", "EOD mask loss.", type=_boolean, default=False),
        Option(
            "megatron_lm_overlap_cpu_optimizer_d2h_h2d", "Overlap CPU optimizer copies.", type=_boolean, default=False
        ),
        Option("megatron_lm_no_save_optim", "Do not save the optimizer.", type=_boolean, default=False),
        Option("megatron_lm_optimizer_cpu_offload", "CPU offload of the optimizer.", type=_boolean, default=False),
        Option("megatron_lm_use_precision_aware_optimizer", "Precision-aware optimizer.", type=_boolean, default=False),
        Option("megatron_lm_decoder_last_pipeline_num_layers", "Layers of the last pipeline stage.", type=int),
        Option("megatron_lm_pp_degree", "Pipeline parallel degree.", type=int, default=1),
        Option("megatron_lm_num_micro_batches", "Micro batches.", type=int),
        Option("megatron_lm_sequence_parallelism", "Sequence parallelism."),
        Option("megatron_lm_recompute_activations", "Selective activation recomputation."),
        Option("megatron_lm_use_distributed_optimizer", "Distributed optimizer."),
        Option("megatron_lm_gradient_clipping", "Gradient clipping.", type=float, default=1.0),
        Option("megatron_lm_recompute_granularity", "Recompute granularity."),
        Option("megatron_lm_recompute_method", "Recompute method."),
        Option("megatron_lm_recompute_num_layers", "Layers to recompute.", type=int),
        Option("megatron_lm_attention_backend", "Attention backend."),
        Option("megatron_lm_expert_model_parallel_size", "Expert model parallel size.", type=int),
        Option("megatron_lm_context_parallel_size", "Context parallel size.", type=int),
        Option("megatron_lm_attention_dropout", "Attention dropout.", type=float),
        Option("megatron_lm_hidden_dropout", "Hidden dropout.", type=float),
        Option("megatron_lm_attention_softmax_in_fp32", "Attention softmax in fp32."),
        Option("megatron_lm_expert_tensor_parallel_size", "Expert tensor parallel size.", type=int),
        Option("megatron_lm_calculate_per_token_loss", "Per-token loss."),
        Option("megatron_lm_use_rotary_position_embeddings", "Rotary position embeddings."),
    ),
    backend="megatron_lm",
)
_FP8 = Group(
    "FP8",
    (
        Option("fp8_backend", "FP8 backend.", choices=("ao", "te", "msamp")),
        _flag("fp8_use_autocast_during_eval", "FP8 autocast in eval mode."),
        Option("fp8_margin", "Margin of the scaling.", type=int, default=0),
        Option("fp8_interval", "Scaling factor recompute interval.", type=int, default=1),
        Option("fp8_format", "FP8 recipe format.", default="HYBRID", choices=("HYBRID", "E4M3", "E5M2")),
        Option("fp8_amax_history_len", "Amax history length.", type=int, default=1024),
        Option("fp8_amax_compute_algo", "Amax algorithm.", default="most_recent", choices=("max", "most_recent")),
        Option(
            "fp8_override_linear_precision",
            "fprop,dgrad,wgrad in higher precision.",
            type=_booleans,
            default=(False, False, False),
        ),
        Option("fp8_opt_level", "MS-AMP optimization level.", default="O2", choices=("O1", "O2")),
        Option("fp8_enable_fsdp_float8_all_gather", "FSDP2 float8 all-gather.", type=_boolean, default=True),
        Option("fp8_pad_inner_dim", "Pad the inner dimension of FP8 GEMMs.", type=_boolean, default=True),
    ),
    backend="fp8",
)
_TPU = Group(
    "TPU",
    (
        _flag("tpu", "Train on TPUs."),
        Option("tpu_cluster", "Use a TPU pod.", action="store_true", default=False, dest="tpu_use_cluster"),
        Option(
            "no_tpu_cluster",
            "Internal to HF's TPU pod launcher.",
            action="store_false",
            default=False,
            dest="tpu_use_cluster",
        ),
        _flag("tpu_use_sudo", "Use sudo on the TPU pod."),
        Option("vm", "Compute VM instance names (TPU pods).", action="append"),
        Option("env", "Environment variables for the Compute VMs (TPU pods).", action="append"),
    ),
    backend="tpu",
)
_AWS = Group(
    "Amazon SageMaker",
    (
        Option("aws_access_key_id", "AWS access key id of the SageMaker job."),
        Option("aws_secret_access_key", "AWS secret access key of the SageMaker job."),
    ),
    backend="sagemaker",
)
_MPI = Group("mpirun", (Option("mpirun_hostfile", "Hostfile for launching with mpirun."),), backend="mpirun")
_PARALLELISM = Group(
    "Parallelism config",
    (
        _flag(
            "use_parallelism_config",
            "Configure the N-d distributed training with the parallelism config (needs --use_fsdp and "
            "--fsdp_version 2; accel runs its data-parallel sizes).",
        ),
        Option(
            "parallelism_config_dp_replicate_size",
            "Processes for data-parallel replicas (with dp_shard_size: HSDP). Default 1.",
            type=int,
            default=1,
        ),
        Option("parallelism_config_dp_shard_size", "Processes FSDP shards across. Default 1.", type=int, default=1),
        Option(
            "parallelism_config_tp_size",
            "Tensor parallel size (above 1 refused: not run by accel).",
            type=int,
            default=1,
        ),
        Option("parallelism_config_cp_size", "Context parallel size (above 1 refused).", type=int, default=1),
        Option(
            "parallelism_config_cp_backend", "Context parallel backend: torch.", default="torch", choices=("torch",)
        ),
        Option(
            "parallelism_config_cp_comm_strategy",
            "Context parallel communication: allgather (default) or alltoall.",
            default="allgather",
        ),
        Option("parallelism_config_sp_size", "Sequence parallel size (above 1 refused).", type=int, default=1),
        Option(
            "parallelism_config_sp_backend",
            "Sequence parallel backend: deepspeed (ALST/Ulysses).",
            default="deepspeed",
            choices=("deepspeed",),
        ),
        Option("parallelism_config_sp_seq_length", "Sequence length when all batches have the same length."),
        Option(
            "parallelism_config_sp_seq_length_is_variable",
            "The sequence length may change between batches (true|false; default true).",
            type=_boolean,
            default=True,
        ),
        Option(
            "parallelism_config_sp_attn_implementation",
            "Attention implementation: flash_attention_2, flash_attention_3, sdpa (default) or a hub kernel.",
            default="sdpa",
        ),
    ),
)

_ACCEL = Group(
    "accel's own",
    (
        _flag(
            "as_accelerate",
            "Make `import accelerate` resolve to accel in every rank, so libraries built on HF "
            "Accelerate (transformers' Trainer, TRL, PEFT) run on accel (ACCEL_AS_ACCELERATE=1).",
        ),
    ),
)
GROUPS = (
    _HARDWARE,
    _RESOURCES,
    _DISTRIBUTED,
    _DEEPSPEED,
    _FSDP,
    _MEGATRON,
    _FP8,
    _TPU,
    _AWS,
    _MPI,
    _PARALLELISM,
    _ACCEL,
)
_REFUSED = {option.dest or option.name: group.backend for group in GROUPS if group.backend for option in group.options}


def _records_given(base: type[argparse.Action]) -> type[argparse.Action]:
    """`base`, also noting in `namespace.nondefault` that the option was given and how it was spelt."""

    class Recording(base):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            given = getattr(namespace, "nondefault", None) or {}
            given.setdefault(self.dest, option_string)
            namespace.nondefault = given

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


_ACTIONS = {
    name: _records_given(base)
    for name, base in (
        ("store", argparse._StoreAction),
        ("store_true", argparse._StoreTrueAction),
        ("store_false", argparse._StoreFalseAction),
        ("append", argparse._AppendAction),
    )
}


def _add(container: argparse._ActionsContainer, option: Option) -> None:
    spellings = [f"--{option.name}"]
    if "_" in option.name:
        spellings.append(f"--{option.name.replace('_', '-')}")
    if option.short:
        spellings.insert(0, option.short)
    kwargs: dict[str, Any] = {"dest": option.dest or option.name, "default": option.default, "help": option.help}
    if option.action in ("store", "append"):
        kwargs.update(type=option.type, choices=option.choices)
    container.add_argument(*spellings, action=_ACTIONS[option.action], **kwargs)


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Adds every option of `accelerate launch`, grouped as HF's help groups them (see the module docstring)."""
    for group in GROUPS:
        title = f"{group.title} (not supported by accel: refused when given)" if group.backend else group.title
        container = parser.add_argument_group(title)
        for option in group.options:
            _add(container, option)
    parser.set_defaults(nondefault={})


def given_options(args: argparse.Namespace) -> dict[str, str]:
    """{dest: option string as typed} of the options given on the command line."""
    return dict(getattr(args, "nondefault", None) or {})


def first_refused(args: argparse.Namespace) -> UnsupportedFeatureError | None:
    """The refusal for the first option given that belongs to a backend accel does not run, if any."""
    for dest, spelling in given_options(args).items():
        if dest in _REFUSED:
            return refuse_backend(_REFUSED[dest], spelling)
    return None


def closest_option(unknown: str, parser: argparse.ArgumentParser) -> str | None:
    """The option of `parser` closest to `unknown`, in its underscore spelling (dashes and underscores count alike)."""
    name = unknown.split("=", 1)[0].lstrip("-").replace("-", "_")
    known = {
        spelling.lstrip("-").replace("-", "_")
        for action in parser._actions
        for spelling in action.option_strings
        if spelling.startswith("--")
    }
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"--{close[0]}" if close else None
