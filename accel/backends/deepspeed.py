"""DeepSpeed's configuration: HF Accelerate's `DeepSpeedPlugin`, `HfDeepSpeedConfig`, `DummyOptim` / `DummyScheduler`.

`DeepSpeedPlugin(...)` and `HfDeepSpeedConfig(...)` build and query a DeepSpeed configuration exactly as HF
Accelerate does (a JSON file, a dict, a JSON or base64 string; "auto" values; ACCEL_/ACCELERATE_DEEPSPEED_*
variables). The engine runs in accel.strategies.deepspeed (DeepSpeed itself, an optional dependency); this module
imports neither torch nor DeepSpeed until a function needs them.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import json
import os
import warnings
from typing import Any

from accel.env_vars import get_setting, parse_bool

INSTALL = "pip install 'accel[deepspeed]' (or: pip install deepspeed)"


def require_deepspeed() -> None:
    """Raises ImportError, naming the install command, unless DeepSpeed is installed."""
    from accel.availability import is_deepspeed_available

    if not is_deepspeed_available():
        raise ImportError(f"DeepSpeed is not installed => run `{INSTALL}`.")


class HfDeepSpeedConfig:
    """A DeepSpeed configuration dictionary, queried by dotted keys ("zero_optimization.stage").

    Args:
        config_file_or_dict: A path to a JSON file, a dict (deep-copied), or the JSON / urlsafe-base64 JSON text.
    """

    def __init__(self, config_file_or_dict: str | dict):
        self.config = _load_config(config_file_or_dict)
        self.set_stage_and_offload()

    def set_stage_and_offload(self) -> None:
        """Reads the ZeRO stage and whether parameters or optimizer states are offloaded (cpu / nvme)."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {
            self.get_value("zero_optimization.offload_optimizer.device"),
            self.get_value("zero_optimization.offload_param.device"),
        }
        self._offload = (self.is_zero2() or self.is_zero3()) and bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        """(the dict holding the last key of `ds_key_long`, that key); the dict is None if a parent is missing."""
        *parents, key = ds_key_long.split(".")
        node = self.config
        for parent in parents:
            node = node.get(parent)
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at the dotted key, or `default`."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Removes the sub-tree at the dotted key (a ValueError when missing and `must_exist`)."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        node.pop(key)

    def is_true(self, ds_key_long: str) -> bool:
        """True only when the value is set and truthy."""
        value = self.get_value(ds_key_long)
        return value is not None and bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """True only when the value is set and falsy."""
        value = self.get_value(ds_key_long)
        return value is not None and not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


def _load_config(source: str | dict) -> dict:
    if isinstance(source, dict):
        return copy.deepcopy(source)  # "auto" values get filled in: the caller's dict stays reusable
    if isinstance(source, (str, os.PathLike)) and os.path.exists(source):
        with open(source, encoding="utf-8") as file:
            return json.load(file)
    try:
        try:
            return json.loads(source)
        except json.JSONDecodeError:
            return json.loads(base64.urlsafe_b64decode(source).decode("utf-8"))
    except (UnicodeDecodeError, AttributeError, TypeError, ValueError):
        raise ValueError(
            "Expected a string path to an existing deepspeed config, or a dictionary, or a base64 "
            f"encoded string. Received: {source}"
        ) from None


# The plugin's fields and the config keys they fill.
_PLUGIN_TO_CONFIG = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
# Settings a config file's `deepspeed_config_file` replaces (HF refuses to mix them).
_IGNORED_WITH_CONFIG_FILE = [
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
    "mixed_precision",
]


@dataclasses.dataclass
class DeepSpeedPlugin:
    """HF Accelerate's DeepSpeed plugin: builds the DeepSpeed configuration the engine runs with.

    Unset fields come from ACCEL_/ACCELERATE_ variables (GRADIENT_ACCUMULATION_STEPS, GRADIENT_CLIPPING,
    DEEPSPEED_ZERO_STAGE, DEEPSPEED_OFFLOAD_*, DEEPSPEED_ZERO3_SAVE_16BIT_MODEL, DEEPSPEED_CONFIG_FILE,
    DEEPSPEED_ZERO3_INIT, FP8_BACKEND, FP8_OPT_LEVEL) with HF's defaults (ZeRO stage 2, no offload, "auto").
    `hf_ds_config` (a path, dict or `HfDeepSpeedConfig`) takes precedence over the fields, as in HF.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None

    def __post_init__(self) -> None:
        self._fields_from_env()
        if self.hf_ds_config is None:
            self.hf_ds_config = get_setting("DEEPSPEED_CONFIG_FILE", "none")
        given = isinstance(self.hf_ds_config, (dict, HfDeepSpeedConfig)) or self.hf_ds_config != "none"
        if given:
            self._from_config()
        else:
            self.hf_ds_config = HfDeepSpeedConfig(self._config_from_fields())
        self.deepspeed_config = self.hf_ds_config.config
        self.deepspeed_config["steps_per_print"] = float("inf")  # keeps DeepSpeed quiet on stdout
        self._resolve_zero3_init()
        self._set_selected(False)
        self._add_msamp()

    def _fields_from_env(self) -> None:
        if self.gradient_accumulation_steps is None:
            steps = get_setting("GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(steps) if steps.isdigit() else steps
        if self.gradient_clipping is None:
            clipping = get_setting("GRADIENT_CLIPPING", "auto")
            self.gradient_clipping = clipping if clipping == "auto" else float(clipping)
        if self.zero_stage is None:
            self.zero_stage = int(get_setting("DEEPSPEED_ZERO_STAGE", "2"))
        for name in (
            "offload_optimizer_device",
            "offload_param_device",
            "offload_optimizer_nvme_path",
            "offload_param_nvme_path",
        ):
            if getattr(self, name) is None:
                setattr(self, name, get_setting(f"DEEPSPEED_{name.upper()}", "none"))
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = get_setting("DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
        if self.enable_msamp is None:
            self.enable_msamp = get_setting("FP8_BACKEND") == "MSAMP"
        if self.msamp_opt_level is None:
            self.msamp_opt_level = get_setting("FP8_OPT_LEVEL", "O1")

    def _from_config(self) -> None:
        if not isinstance(self.hf_ds_config, HfDeepSpeedConfig):
            self.hf_ds_config = HfDeepSpeedConfig(self.hf_ds_config)
        config = self.hf_ds_config.config
        config.setdefault("gradient_accumulation_steps", 1)
        if "zero_optimization" not in config:
            raise ValueError("Please specify the ZeRO optimization config in the DeepSpeed config.")
        self._deepspeed_config_checks()
        kwargs = {
            key: getattr(self, name) for name, key in _PLUGIN_TO_CONFIG.items() if getattr(self, name) is not None
        }
        for key in kwargs:
            self.fill_match(key, **kwargs, must_match=False)
        self.hf_ds_config.set_stage_and_offload()
        for name, key in _PLUGIN_TO_CONFIG.items():  # the file's values win over the fields
            value = self.hf_ds_config.get_value(key)
            if value is not None and value != "auto":
                setattr(self, name, value)

    def _config_from_fields(self) -> dict:
        def offload(device: str, nvme_path: str) -> dict:
            return {"device": device, "nvme_path": nvme_path if device == "nvme" else None}

        config = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _resolve_zero3_init(self) -> None:
        if self.zero3_init_flag is None:
            value = get_setting("DEEPSPEED_ZERO3_INIT", str(self.hf_ds_config.is_zero3()))
            self.zero3_init_flag = parse_bool(value, "ACCEL_DEEPSPEED_ZERO3_INIT")
        if self.zero3_init_flag and not self.hf_ds_config.is_zero3():
            warnings.warn("DeepSpeed Zero3 Init flag is only applicable for ZeRO Stage 3. Setting it to False.")
            self.zero3_init_flag = False

    def _add_msamp(self) -> None:
        if not self.enable_msamp or "msamp" in self.deepspeed_config:
            return
        if self.zero_stage == 3:
            raise NotImplementedError(
                "MS-AMP is not supported for ZeRO Stage 3. Please use ZeRO Stage 0, 1, or 2 instead."
            )
        if self.msamp_opt_level not in ("O1", "O2"):
            raise ValueError("Invalid optimization level for MS-AMP. Please use one of ['O1' or'O2'].")
        self.deepspeed_config["msamp"] = {"enabled": True, "opt_level": self.msamp_opt_level}

    def fill_match(self, ds_key_long: str, mismatches: list | None = None, must_match: bool = True, **kwargs) -> None:
        """Fills an "auto" value at `ds_key_long` from `kwargs` (a ValueError if kwargs lack it); with `must_match`,
        records into `mismatches` a set value that differs from `kwargs`."""
        mismatches = [] if mismatches is None else mismatches
        node, key = self.hf_ds_config.find_config_node(ds_key_long)
        if node is None:
            return
        if node.get(key) == "auto":
            if ds_key_long not in kwargs:
                raise ValueError(
                    f"`{ds_key_long}` not found in kwargs. Please specify `{ds_key_long}` without `auto` "
                    "(set to correct value) in the DeepSpeed config file or pass it in kwargs."
                )
            node[key] = kwargs[ds_key_long]
            return
        value = node.get(key)
        if must_match and value is not None and ds_key_long in kwargs and value != kwargs[ds_key_long]:
            mismatches.append(f"- ds {ds_key_long}={value} vs arg {ds_key_long}={kwargs[ds_key_long]}")

    def is_auto(self, ds_key_long: str) -> bool:
        return self.hf_ds_config.get_value(ds_key_long) == "auto"

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self.hf_ds_config.get_value(ds_key_long, default)

    def deepspeed_config_process(
        self,
        prefix: str = "",
        mismatches: list | None = None,
        config: dict | None = None,
        must_match: bool = True,
        **kwargs,
    ) -> None:
        """Fills every "auto" value of the config from `kwargs`; a ValueError lists values that contradict them."""
        mismatches = [] if mismatches is None else mismatches
        for key, value in (self.deepspeed_config if config is None else config).items():
            if isinstance(value, dict):
                self.deepspeed_config_process(prefix + key + ".", mismatches, value, must_match, **kwargs)
            else:
                self.fill_match(prefix + key, mismatches, must_match=must_match, **kwargs)
        if mismatches and prefix == "":
            raise ValueError(
                "Please correct the following DeepSpeed config values that mismatch kwargs values:\n"
                + "\n".join(mismatches)
                + "\nThe easiest method is to set these DeepSpeed config values to 'auto'."
            )

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Writes the fp16 / bf16 sections for `mixed_precision` (fp8 trains under bf16, as in HF)."""
        config = self.deepspeed_config
        if mixed_precision == "fp16":
            config.setdefault("fp16", {"enabled": True, "auto_cast": True})
        elif mixed_precision in ("bf16", "fp8"):
            config.setdefault("bf16", {"enabled": True})
        if mixed_precision == "fp8" and self.enable_msamp:
            config.setdefault("msamp", {"enabled": True, "opt_level": self.msamp_opt_level})
        if mixed_precision != "no":
            other = "bf16" if mixed_precision == "fp16" else "fp16"
            if str(config.get(other, {}).get("enabled", "False")).lower() == "true":
                raise ValueError(
                    f"`--mixed_precision` arg cannot be set to `{mixed_precision}` when `{other}` is "
                    "set in the DeepSpeed config file."
                )
        for dtype in ("fp16", "bf16"):
            config.setdefault(dtype, {"enabled": False})
        enabled = {"fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision in ("bf16", "fp8")}
        self.fill_match("fp16.enabled", must_match=False, **enabled)
        self.fill_match("bf16.enabled", must_match=False, **enabled)

    def _deepspeed_config_checks(self) -> None:
        fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
        if any(name in _IGNORED_WITH_CONFIG_FILE for name in fields):
            raise ValueError(
                f"When using `deepspeed_config_file`, the following accel config variables will be ignored: "
                f"{_IGNORED_WITH_CONFIG_FILE}.\nPlease specify them appropriately in the DeepSpeed config file.\n"
                "If you are using an accel config file, remove others config variables mentioned in the above "
                "specified list.\nThe easiest method is to create a new config following the questionnaire via "
                "`accel config`.\nIt will only ask for the necessary config variables when using "
                "`deepspeed_config_file`."
            )

    def is_zero3_init_enabled(self) -> bool:
        return self.zero3_init_flag

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False):
        """Turns ZeRO-3 init (models built partitioned, via transformers' DeepSpeed config) on or off for the block."""
        old = self.zero3_init_flag
        if old == enable:
            yield
            return
        self.zero3_init_flag = enable
        self.dschf = None
        self.set_deepspeed_weakref()
        try:
            yield
        finally:
            self.zero3_init_flag = old
            self.dschf = None
            self.set_deepspeed_weakref()

    def set_deepspeed_weakref(self) -> None:
        """Hands this config to transformers (its `HfDeepSpeedConfig`, kept alive here), so that `from_pretrained`
        builds models partitioned under ZeRO-3 init and transformers' `is_deepspeed_zero3_enabled()` answers."""
        from accel.availability import is_transformers_available

        if self.zero3_init_flag and not is_transformers_available():
            raise Exception(
                "When `zero3_init_flag` is set, it requires Transformers to be installed. "
                "Please run `pip install transformers`."
            )
        if not is_transformers_available():
            return
        from transformers.integrations import HfDeepSpeedConfig as TransformersConfig
        from transformers.integrations import unset_hf_deepspeed_config

        config = copy.deepcopy(self.deepspeed_config)
        if config.get("gradient_accumulation_steps", "auto") == "auto":
            config["gradient_accumulation_steps"] = 1
        if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            config["train_micro_batch_size_per_gpu"] = 1
        if config.get("train_batch_size") == "auto":
            del config["train_batch_size"]
        unset_hf_deepspeed_config()
        self.dschf = TransformersConfig(config)  # transformers keeps only a weak reference

    def set_moe_leaf_modules(self, model: Any) -> None:
        """Marks the model's MoE layer classes (`transformer_moe_cls_names`, or
        ACCEL(ERATE)_DEEPSPEED_MOE_LAYER_CLS_NAMES) as ZeRO-3 leaf modules, as HF does."""
        if self.transformer_moe_cls_names is None:
            self.transformer_moe_cls_names = get_setting("DEEPSPEED_MOE_LAYER_CLS_NAMES")
        if self.transformer_moe_cls_names is None:
            return
        from deepspeed.utils import set_z3_leaf_modules

        from accel.backends.fsdp import get_module_class_from_name

        classes = []
        for name in self.transformer_moe_cls_names.split(","):
            found = get_module_class_from_name(model, name)
            if found is None:
                raise Exception(f"Could not find a transformer layer class called '{name}' to wrap in the model.")
            classes.append(found)
        set_z3_leaf_modules(model, classes)

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Makes this plugin the active one; only `AcceleratorState` may (`select_deepspeed_plugin`)."""
        if not _from_accelerator_state:
            raise ValueError(
                "A `DeepSpeedPlugin` object must be enabled manually by calling "
                "`AcceleratorState().select_deepspeed_plugin(plugin_key)`."
            )
        self.set_deepspeed_weakref()
        self._set_selected(True)

    def _unselect(self) -> None:
        self._set_selected(False)

    def _set_selected(self, value: bool) -> None:
        self._selected = value

    @property
    def selected(self) -> bool:
        """Whether this plugin is the active one."""
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        raise NotImplementedError(
            "'enabled' can only be set through calling 'AcceleratorState().select_deepspeed_plugin(key)'."
        )


class DummyOptim:
    """Stands for the optimizer a DeepSpeed config file defines (`prepare` hands its parameters to the engine).

    Args:
        params: The parameters (or parameter groups) to optimize.
        lr: Learning rate.
        weight_decay: Weight decay.
        **kwargs: Other arguments.
    """

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs):
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler a DeepSpeed config file defines, or one `lr_scheduler_callable` builds.

    Args:
        optimizer: The optimizer.
        total_num_steps: Total number of steps.
        warmup_num_steps: Warmup steps.
        lr_scheduler_callable: Builds the scheduler from the optimizer.
        **kwargs: Other arguments.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Any = None,
        **kwargs,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def get_active_deepspeed_plugin(state: Any) -> DeepSpeedPlugin:
    """The selected plugin of `state` (an AcceleratorState running DeepSpeed).

    Raises:
        ValueError: DeepSpeed is not enabled, or no plugin is selected.
    """
    plugins = getattr(state, "deepspeed_plugins", None)
    if plugins is None:
        raise ValueError("DeepSpeed is not enabled, cannot get active DeepSpeed plugin.")
    if not isinstance(plugins, dict):
        return plugins
    active = next((plugin for plugin in plugins.values() if plugin.selected), None)
    if active is None:
        raise ValueError("No DeepSpeed plugin is selected: call AcceleratorState().select_deepspeed_plugin(name)")
    return active


def map_pytorch_optim_to_deepspeed(optimizer: Any) -> Any:
    """DeepSpeed's CPU version of a torch optimizer (what ZeRO-Offload runs the optimizer state with), with its
    learning rate and weight decay: DeepSpeedCPUAdam for Adam / AdamW (AdamW mode for AdamW), DeepSpeedCPUAdagrad
    for Adagrad, DeepSpeedCPULion for bitsandbytes' Lion, as HF maps them. DeepSpeed JIT-builds the op on first use.
    """
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = {key: value for key, value in optimizer.defaults.items() if key in ("lr", "weight_decay")}
    optimizer_class: Any = DeepSpeedCPUAdam
    defaults["adamw_mode"] = isinstance(optimizer, torch.optim.AdamW)
    if isinstance(optimizer, torch.optim.Adagrad):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        optimizer_class = DeepSpeedCPUAdagrad
        defaults.pop("adamw_mode")
    elif type(optimizer).__name__ in ("Lion", "Lion32bit") and type(optimizer).__module__.startswith("bitsandbytes"):
        from deepspeed.ops.lion import DeepSpeedCPULion

        optimizer_class = DeepSpeedCPULion
        defaults.pop("adamw_mode")
    return optimizer_class(optimizer.param_groups, **defaults)


__all__ = [
    "DeepSpeedPlugin",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
    "require_deepspeed",
]
