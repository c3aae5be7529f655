"""FSDP's names (accel does not run FSDP yet): the plugin, and HF Accelerate's `utils.fsdp_utils` helpers.

`FullyShardedDataParallelPlugin(...)` resolves its fields as HF Accelerate does (FSDP_* variables, the same
defaults, torch's FSDP enums and policies), so scripts and configs that build one work; passing it to
`Accelerator` is refused. Of the helpers, those that need sharded models (saving, loading, preparing FSDP2
models) are refused; those that do not work: the RAM-efficient-loading toggles (environment variables
transformers reads), `ensure_weights_retied`, `fsdp2_canonicalize_names`, `fsdp2_switch_optimizer_parameters`,
`get_fsdp2_grad_scaler` and `get_parameters_from_modules` (TRL imports it at start-up). (`merge_fsdp_weights`,
which only reads files, lives with the launch helpers.)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Callable

import torch

from accel.backends import DDP_INSTEAD, env_flag
from accel.env_vars import parse_bool
from accel.unsupported import refuse

FEATURE = "FSDP"
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
_PRECISION_DTYPES = {"fp8": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _refuse(asked_by: str):
    return refuse(FEATURE, asked_by, DDP_INSTEAD)


def _mesh_strategy_from_launcher() -> str | None:
    """The FSDP1 strategy FSDP2 runs on a 2-D mesh (HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD) that `accel launch`
    exports as FSDP_SHARDING_STRATEGY beside FSDP_VERSION=2 when it translates an FSDP1 configuration; None for any
    other value, which FSDP2 reads from FSDP_RESHARD_AFTER_FORWARD instead (as HF does)."""
    from accel.backends.fsdp_options import MESH_STRATEGIES

    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "").strip().upper()
    return strategy if strategy in MESH_STRATEGIES else None


def _fsdp_enum(value: Any, enum_cls: type, names: list[str]) -> Any:
    """HF's parsing of an FSDP enum: a member, a name from `names` (1-based position), a number, or a member name."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value.upper() in names:
        value = names.index(value.upper()) + 1
    if isinstance(value, int) or value.isdigit():
        return enum_cls(int(value))
    return enum_cls[value.upper()]


def _bool(value: str) -> bool:
    return parse_bool(value, "reshard_after_forward")


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """HF Accelerate's FSDP plugin (fields, FSDP_* variables, defaults and checks); accel refuses to run it.

    See HF Accelerate's documentation for each field. `fsdp_version` 1 (default, FSDP_VERSION) or 2 decides how
    `reshard_after_forward`, `cpu_offload` and `mixed_precision_policy` are expressed.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        notes: set[str] = set()  # FSDP2 deprecation notes, warned about once at the end (as HF)
        if self.fsdp_version is None:
            self.fsdp_version = int(os.environ.get("FSDP_VERSION", "1"))
        self._resolve_sharding(notes)
        if self.cpu_offload is None:
            self.cpu_offload = env_flag("FSDP_OFFLOAD_PARAMS")
        self.set_cpu_offload()
        self.validate_cpu_offload()
        self._resolve_backward_prefetch(notes)
        self.set_state_dict_type()
        self._resolve_auto_wrap_policy()
        self._resolve_version_flags(notes)
        self._resolve_loading()
        self._resolve_mixed_precision()
        if self.sync_module_states and self.param_init_fn is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
            self.param_init_fn = lambda module: module.to_empty(device=device, recurse=False)
        if notes:
            warnings.warn("Multiple deprecation warnings due to FSDP2 conversion:\n" + "\n".join(sorted(notes)))

    def _resolve_sharding(self, notes: set[str]) -> None:
        from torch.distributed.fsdp import ShardingStrategy

        if self.sharding_strategy is not None:
            notes.add("sharding_strategy is deprecated in favor of reshard_after_forward.")
        if self.fsdp_version == 1:
            if self.sharding_strategy is None:
                self.sharding_strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
            self.sharding_strategy = _fsdp_enum(self.sharding_strategy, ShardingStrategy, FSDP_SHARDING_STRATEGY)
        if self.reshard_after_forward is None and self.sharding_strategy is None:
            self.reshard_after_forward = os.environ.get(
                "FSDP_RESHARD_AFTER_FORWARD", "true" if self.fsdp_version == 2 else "FULL_SHARD"
            )
        if isinstance(self.reshard_after_forward, str):
            if self.fsdp_version == 2:
                self.reshard_after_forward = _bool(self.reshard_after_forward)
            else:
                self.reshard_after_forward = _fsdp_enum(
                    self.reshard_after_forward, ShardingStrategy, FSDP_SHARDING_STRATEGY
                )
        if self.fsdp_version == 2 and self.sharding_strategy is None:
            self.sharding_strategy = _mesh_strategy_from_launcher()
        is_bool = isinstance(self.reshard_after_forward, bool)
        if self.fsdp_version == 2 and not is_bool:
            raise ValueError(
                f"reshard_after_forward set to {self.reshard_after_forward}. This is not supported with "
                "FSDP2, please set to a `bool`"
            )
        if self.fsdp_version == 1 and is_bool:
            raise ValueError(
                f"reshard_after_forward set to {self.reshard_after_forward}. This is not supported with "
                "FSDP1, please set to a `str` or an instance of `ShardingStrategy`"
            )

    def _resolve_backward_prefetch(self, notes: set[str]) -> None:
        from torch.distributed.fsdp import BackwardPrefetch

        if self.backward_prefetch is None:
            self.backward_prefetch = os.environ.get("FSDP_BACKWARD_PREFETCH", None)
        if isinstance(self.backward_prefetch, str) and self.backward_prefetch.upper() == "NO_PREFETCH":
            self.backward_prefetch = None
        if self.backward_prefetch is not None:
            self.backward_prefetch = _fsdp_enum(self.backward_prefetch, BackwardPrefetch, FSDP_BACKWARD_PREFETCH)
        if self.fsdp_version == 2 and self.backward_prefetch is not None:
            notes.add("backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.")
            self.backward_prefetch = None

    def _resolve_auto_wrap_policy(self) -> None:
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
        if not isinstance(self.auto_wrap_policy, str):
            return
        policy = self.auto_wrap_policy.upper()
        if policy not in FSDP_AUTO_WRAP_POLICY:
            raise ValueError(
                f"Invalid auto wrap policy: {self.auto_wrap_policy}. Must be one of {FSDP_AUTO_WRAP_POLICY}"
            )
        if policy == "TRANSFORMER_BASED_WRAP":
            self.auto_wrap_policy = transformer_auto_wrap_policy
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", None)
            if isinstance(self.transformer_cls_names_to_wrap, str):
                self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
        elif policy == "SIZE_BASED_WRAP":
            self.auto_wrap_policy = size_based_auto_wrap_policy
            if self.min_num_params is None:
                self.min_num_params = int(os.environ.get("FSDP_MIN_NUM_PARAMS", 0))
            elif not isinstance(self.min_num_params, int):
                raise ValueError(
                    f"`min_num_params` must be an integer. Got {self.min_num_params} of type "
                    f"{type(self.min_num_params)}"
                )
        else:
            self.auto_wrap_policy = None

    def _resolve_version_flags(self, notes: set[str]) -> None:
        version1 = self.fsdp_version == 1
        if self.use_orig_params is None and version1:
            self.use_orig_params = env_flag("FSDP_USE_ORIG_PARAMS")
        if not version1 and self.use_orig_params is not None:
            notes.add("use_orig_params is obsolete in FSDP2, as FSDP2 always uses the original parameters.")
            self.use_orig_params = None
        if self.sync_module_states is None and version1:
            self.sync_module_states = env_flag("FSDP_SYNC_MODULE_STATES")
        if not version1 and self.sync_module_states is not None:
            notes.add("sync_module_states is obsolete in FSDP2, as it is not needed anymore.")
            self.sync_module_states = None
        if self.forward_prefetch is None and version1:
            self.forward_prefetch = env_flag("FSDP_FORWARD_PREFETCH")
        if not version1 and self.forward_prefetch is not None:
            raise ValueError("forward_prefetch is not yet implemented in FSDP2, set to None or use `fsdp_version=1`")
        if self.activation_checkpointing is None:
            self.activation_checkpointing = env_flag("FSDP_ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = env_flag("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("`activation_checkpointing_offload=True` requires `activation_checkpointing=True`.")
        if self.activation_checkpointing_offload and self.fsdp_version != 2:
            raise ValueError("`activation_checkpointing_offload=True` requires `fsdp_version=2`.")

    def _resolve_loading(self) -> None:
        if self.ignored_modules is None:
            self.ignored_modules = os.environ.get("FSDP_IGNORED_MODULES", None)
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")
        else:  # transformers reads the variable, as with HF Accelerate
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading)
        if self.fsdp_version == 1 and self.cpu_ram_efficient_loading and not self.sync_module_states:
            warnings.warn(
                "sync_module_states cannot be False since efficient cpu ram loading enabled. "
                "Setting sync_module_states to True."
            )
            self.sync_module_states = True

    def _resolve_mixed_precision(self) -> None:
        if isinstance(self.mixed_precision_policy, str):
            self.set_mixed_precision(self.mixed_precision_policy, override=True)
        elif isinstance(self.mixed_precision_policy, dict):
            self.set_mixed_precision(self.mixed_precision_policy)
        if self.mixed_precision_policy is not None:
            self.validate_mixed_precision_policy()

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Resolves `state_dict_type` (FSDP_STATE_DICT_TYPE; full for FSDP1, sharded for FSDP2) and its configs."""
        from torch.distributed.fsdp.fully_sharded_data_parallel import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            default = "FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"
            self.state_dict_type = os.environ.get("FSDP_STATE_DICT_TYPE", default)
        if isinstance(self.state_dict_type, str):
            text = self.state_dict_type
            self.state_dict_type = StateDictType(int(text)) if text.isdigit() else StateDictType[text.upper()]
        if self.state_dict_type == StateDictType.FULL_STATE_DICT:
            self.state_dict_config = self.state_dict_config or FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            self.optim_state_dict_config = self.optim_state_dict_config or FullOptimStateDictConfig(
                offload_to_cpu=True, rank0_only=True
            )
        elif self.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            self.state_dict_config = self.state_dict_config or ShardedStateDictConfig(offload_to_cpu=True)
            self.optim_state_dict_config = self.optim_state_dict_config or ShardedOptimStateDictConfig(
                offload_to_cpu=True
            )
        if self.fsdp_version == 2 and self.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            raise ValueError(
                "FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` to "
                "`SHARDED_STATE_DICT` or `FULL_STATE_DICT`."
            )

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Binds the wrap policy to `model`: its transformer layer classes, or the minimum parameter count."""
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        if self.auto_wrap_policy == transformer_auto_wrap_policy:
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
            classes = set()
            for name in self.transformer_cls_names_to_wrap:
                found = get_module_class_from_name(model, name)
                if found is None:
                    raise ValueError(f"Could not find the transformer layer class {name} in the model.")
                classes.add(found)
            self.auto_wrap_policy = functools.partial(self.auto_wrap_policy, transformer_layer_cls=classes)
        elif self.auto_wrap_policy == size_based_auto_wrap_policy:
            # min_num_params 0 means no wrapping, as in HF
            self.auto_wrap_policy = (
                functools.partial(self.auto_wrap_policy, min_num_params=self.min_num_params)
                if self.min_num_params > 0
                else None
            )

    def set_mixed_precision(self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False) -> None:
        """Sets the FSDP mixed-precision policy from "fp8" / "fp16" / "bf16" / "fp32", a dtype, or a dict."""
        dtype = mixed_precision
        if isinstance(mixed_precision, str):
            dtype = _PRECISION_DTYPES.get(mixed_precision)
            if dtype is None:
                raise ValueError(
                    f"Invalid mixed precision: {mixed_precision}. Must be one of {list(_PRECISION_DTYPES)}"
                )
        elif isinstance(mixed_precision, torch.dtype) and mixed_precision not in _PRECISION_DTYPES.values():
            raise ValueError(
                f"Invalid mixed precision: {mixed_precision}. Must be one of {list(_PRECISION_DTYPES.values())}"
            )
        policy_cls = self._mixed_precision_class()
        if override or self.mixed_precision_policy is None:
            third = (
                {"buffer_dtype": torch.float32 if buffer_autocast else dtype}
                if self.fsdp_version == 1
                else {"output_dtype": dtype}
            )
            self.mixed_precision_policy = policy_cls(param_dtype=dtype, reduce_dtype=dtype, **third)
        elif isinstance(self.mixed_precision_policy, dict):
            keys = ["param_dtype", "reduce_dtype", "buffer_dtype" if self.fsdp_version == 1 else "output_dtype"]
            policy = self.mixed_precision_policy
            if any(k not in policy for k in keys) or any(v not in _PRECISION_DTYPES.values() for v in policy.values()):
                raise ValueError(
                    f"Invalid mixed precision policy: {policy}. Must be a `dict` with keys {keys}."
                    f"Values must be one of {list(_PRECISION_DTYPES.values())}"
                )
            self.mixed_precision_policy = policy_cls(**policy)

    def _mixed_precision_class(self) -> type:
        if self.fsdp_version == 2:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            return MixedPrecisionPolicy
        from torch.distributed.fsdp import MixedPrecision

        return MixedPrecision

    def validate_mixed_precision_policy(self) -> None:
        if not isinstance(self.mixed_precision_policy, self._mixed_precision_class()):
            raise ValueError(f"mixed_precision_policy must be an instance of {self._mixed_precision_class().__name__}.")

    def set_cpu_offload(self) -> None:
        """Turns a bool `cpu_offload` into FSDP1's `CPUOffload` or FSDP2's offload policy."""
        if not isinstance(self.cpu_offload, bool):
            return
        if self.fsdp_version == 2:
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

            self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        else:
            from torch.distributed.fsdp import CPUOffload

            self.cpu_offload = CPUOffload(offload_params=self.cpu_offload)

    def validate_cpu_offload(self) -> None:
        from torch.distributed.fsdp import CPUOffload, OffloadPolicy

        expected = OffloadPolicy if self.fsdp_version == 2 else CPUOffload
        if not isinstance(self.cpu_offload, expected):
            raise ValueError(
                f"`cpu_offload` must be an instance of `torch.distributed.fsdp.{expected.__name__}` in "
                f"FSDP{self.fsdp_version}, got {self.cpu_offload}"
            )


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type | None:
    """The class called `name` of `module` or one of its submodules, or None."""
    for submodule in module.modules():
        if type(submodule).__name__ == name:
            return type(submodule)
    return None


def get_parameters_from_modules(
    modules: Iterable[torch.nn.Module] | str | None, model: torch.nn.Module, device: torch.device | str
) -> set[torch.nn.Parameter]:
    """The parameters of `modules` (FSDP2's `ignored_params`, from a plugin's `ignored_modules`), as a set.

    `modules` is modules, or a regex that names them: each module of `model` whose qualified name fully matches
    it is taken, and moved to `device` (as HF Accelerate does, for FSDP2 leaves them where they are), unless its
    parameters are on the meta device (RAM-efficient loading fills them in later). None gives an empty set.
    """
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [
            module if any(p.is_meta for p in module.parameters()) else module.to(device)
            for name, module in model.named_modules()
            if pattern.fullmatch(name)
        ]
    return {parameter for module in modules for parameter in module.parameters()}


# --- utils.fsdp_utils -------------------------------------------------------------------------------------------


def enable_fsdp_ram_efficient_loading() -> None:
    """Tells transformers to load pretrained weights on the first process only (FSDP_CPU_RAM_EFFICIENT_LOADING)."""
    os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undoes `enable_fsdp_ram_efficient_loading` for transformers' loading."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def ensure_weights_retied(param_init_fn: Callable, model: torch.nn.Module, device: torch.device) -> Callable:
    """Wraps `param_init_fn` so that weights `model._tied_weights_keys` names stay tied after re-initialization.

    (`device` is unused, as in HF Accelerate.) Without tied weights, `param_init_fn` is returned unchanged.
    """
    tied_names = getattr(model, "_tied_weights_keys", None)
    if not tied_names:
        return param_init_fn
    tied: dict[int, Any] = {id(model.get_parameter(name)): None for name in tied_names}

    def param_init_fn_tied_param(module: torch.nn.Module) -> torch.nn.Module:
        to_tie = defaultdict(list)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in tied:
                to_tie[id(param)].append(name)
        module = param_init_fn(module)
        for key, names in to_tie.items():
            for name in names:
                if tied[key] is None:  # every later occurrence is tied to the first one re-initialized
                    tied[key] = getattr(module, name)
                else:
                    setattr(module, name, tied[key])
        return module

    return param_init_fn_tied_param


def fsdp2_canonicalize_names(named_params: dict) -> dict:
    """Removes the name parts activation checkpointing and torch.compile add (`._checkpoint_wrapped_module`,
    `_orig_mod.`), mapping parameters back to their original names."""
    named_params = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in named_params.items()}
    named_params = {k.removeprefix("_orig_mod."): v for k, v in named_params.items()}
    return {k.replace("._orig_mod", ""): v for k, v in named_params.items()}


def fsdp2_switch_optimizer_parameters(optimizer: torch.optim.Optimizer, mapping: dict) -> None:
    """Replaces the optimizer's parameters in place by `mapping[param.data_ptr]` (as HF Accelerate keys it).

    Raises:
        KeyError: a parameter has no replacement (training would silently update stale tensors).
    """
    try:
        for group in optimizer.param_groups:
            group["params"] = [mapping[param.data_ptr] for param in group["params"]]
    except KeyError:
        raise KeyError(
            "A parameter in the optimizer couldn't be switched to its sharded version: `mapping` lacks "
            "it, and training would not update it."
        ) from None


def get_fsdp2_grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    """A plain `torch.amp.GradScaler(**kwargs)` (what FSDP2 uses; no sharded scaler)."""
    return torch.amp.GradScaler(**kwargs)


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    output_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    raise _refuse("save_fsdp_model(...)")


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: Any,
    input_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> Any:
    raise _refuse("load_fsdp_model(...)")


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    output_dir: str,
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    raise _refuse("save_fsdp_optimizer(...)")


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    input_dir: str,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    raise _refuse("load_fsdp_optimizer(...)")


def fsdp2_load_full_state_dict(accelerator: Any, model: torch.nn.Module, full_sd: dict, cpu_offload: bool = False):
    raise _refuse("fsdp2_load_full_state_dict(...)")


def fsdp2_apply_ac(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    raise _refuse("fsdp2_apply_ac(...)")


def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    raise _refuse("fsdp2_prepare_model(...)")


__all__ = [
    "FullyShardedDataParallelPlugin",
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
    "get_module_class_from_name",
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]
