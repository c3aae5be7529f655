"""FP8 training's names (accel runs no FP8 engine): recipe handlers, and HF's `utils.ao` / `utils.transformer_engine`.

The recipe handlers (`TERecipeKwargs`, `MSAMPRecipeKwargs`, `AORecipeKwargs`, the deprecated `FP8RecipeKwargs`)
read ACCELERATE_FP8_* variables and validate as HF Accelerate does. Unlike HF, building one does not need its
engine installed (HF raises ImportError without TransformerEngine / torchao), so a script can build its
configuration; passing one to `Accelerator` is refused. The model-inspection helpers work (a model cannot hold
layers of an engine that was never imported); converting or wrapping a model for FP8 is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from typing import Any, Callable, Literal, get_args

import torch

from accel.accelerator_config import KwargsHandler
from accel.availability import is_msamp_available, is_torchao_available
from accel.backends import env_flag
from accel.unsupported import refuse

FEATURE = "FP8 training"
INSTEAD = "accel trains in mixed_precision 'bf16' or 'fp16' (or 'no'); use one of those."
_ENV = "ACCELERATE_FP8_"
# HF's names for the values the recipe fields take.
Backend = Literal["MSAMP", "TE"]
OptLevel = Literal["O1", "O2"]
FP8Format = Literal["HYBRID", "E4M3", "E5M2"]
AmaxComputeAlgorithm = Literal["max", "most_recent"]
_FORMATS, _AMAX_ALGORITHMS = get_args(FP8Format), get_args(AmaxComputeAlgorithm)
_OPT_LEVELS, _BACKENDS = get_args(OptLevel), get_args(Backend)


def _refuse(engine: str, asked_by: str):
    return refuse(f"{FEATURE} ({engine})", asked_by, INSTEAD)


@dataclasses.dataclass
class AORecipeKwargs(KwargsHandler):
    """torchao FP8 recipe: `config` (a `Float8LinearConfig`, built from the two flags when torchao is installed)
    and `module_filter_func`; ACCELERATE_FP8_PAD_INNER_DIM / _ENABLE_FSDP_FLOAT8_ALL_GATHER (default True)."""

    config: Any = None
    module_filter_func: Callable | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        if self.config is not None:
            return
        if self.pad_inner_dim is None:
            self.pad_inner_dim = env_flag(_ENV + "PAD_INNER_DIM", True)
        if self.enable_fsdp_float8_all_gather is None:
            self.enable_fsdp_float8_all_gather = env_flag(_ENV + "ENABLE_FSDP_FLOAT8_ALL_GATHER", True)
        if is_torchao_available():
            from torchao.float8 import Float8LinearConfig

            self.config = Float8LinearConfig(
                pad_inner_dim=self.pad_inner_dim, enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather
            )


@dataclasses.dataclass
class TERecipeKwargs(KwargsHandler):
    """TransformerEngine FP8 recipe (HF's fields); unset fields read ACCELERATE_FP8_* (FORMAT "HYBRID", MARGIN 0,
    INTERVAL 1, AMAX_HISTORY_LEN 1024, AMAX_COMPUTE_ALGO "most_recent", OVERRIDE_FPROP/DGRAD/WGRAD, ...)."""

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: FP8Format | None = None
    amax_history_len: int | None = None
    amax_compute_algo: AmaxComputeAlgorithm | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None

    def __post_init__(self) -> None:
        if self.use_autocast_during_eval is None:
            self.use_autocast_during_eval = env_flag(_ENV + "USE_AUTOCAST_DURING_EVAL")
        if self.margin is None:
            self.margin = int(os.environ.get(_ENV + "MARGIN", 0))
        if self.interval is None:
            self.interval = int(os.environ.get(_ENV + "INTERVAL", 1))
        self.fp8_format = (self.fp8_format or os.environ.get(_ENV + "FORMAT", "HYBRID")).upper()
        if self.fp8_format not in _FORMATS:
            raise ValueError(f"`fp8_format` must be one of {' or '.join(_FORMATS)}.")
        self.amax_compute_algo = (
            self.amax_compute_algo or os.environ.get(_ENV + "AMAX_COMPUTE_ALGO", "most_recent")
        ).lower()
        if self.amax_compute_algo not in _AMAX_ALGORITHMS:
            raise ValueError(f"`amax_compute_algo` must be one of {' or '.join(_AMAX_ALGORITHMS)}")
        if self.amax_history_len is None:
            self.amax_history_len = int(os.environ.get(_ENV + "AMAX_HISTORY_LEN", 1024))
        if self.override_linear_precision is None:
            self.override_linear_precision = tuple(
                env_flag(_ENV + f"OVERRIDE_{gemm}") for gemm in ("FPROP", "DGRAD", "WGRAD")
            )
        if self.use_mxfp8_block_scaling is None:
            self.use_mxfp8_block_scaling = env_flag(_ENV + "USE_MXFP8_BLOCK_SCALING")


@dataclasses.dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP FP8 recipe: `opt_level` "O1" or "O2" (ACCELERATE_FP8_OPT_LEVEL, default "O2")."""

    opt_level: OptLevel | None = None

    def __post_init__(self) -> None:
        if self.opt_level is None:
            self.opt_level = os.environ.get(_ENV + "OPT_LEVEL", "O2")
        if self.opt_level not in _OPT_LEVELS:
            raise ValueError(f"`opt_level` must be one of {' or '.join(_OPT_LEVELS)}")


@dataclasses.dataclass
class FP8RecipeKwargs(TERecipeKwargs, MSAMPRecipeKwargs):
    """Deprecated (as in HF Accelerate): TransformerEngine and MS-AMP fields plus `backend` ("MSAMP" or "TE")."""

    backend: Backend | None = None

    def __post_init__(self) -> None:
        warnings.warn(
            "FP8RecipeKwargs is deprecated and will be removed in Accelerate v2.0.0. Please use one of the "
            "proper FP8 recipe kwargs classes such as TERecipeKwargs or MSAMPRecipeKwargs instead.",
            FutureWarning,
        )
        if self.backend is None:
            default = "msamp" if is_msamp_available() else "te"
            self.backend = os.environ.get(_ENV + "BACKEND", default)
        self.backend = self.backend.upper()
        if self.backend not in _BACKENDS:
            raise ValueError("`backend` must be 'MSAMP' or 'TE' (TransformerEngine) to use `FP8RecipeKwargs`.")
        TERecipeKwargs.__post_init__(self)
        MSAMPRecipeKwargs.__post_init__(self)


RECIPE_HANDLERS = (FP8RecipeKwargs, AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs)


# --- utils.ao -----------------------------------------------------------------------------------------------------


def find_first_last_linear_layers(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The names of the first and last `nn.Linear` of `model` (kept out of FP8 for stability)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: list[str]) -> bool:
    """Whether torchao should convert `module` named `fqn`: False for a Linear whose in/out features are not
    multiples of 16, and for names in `layers_to_filter`."""
    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """`filter_linear_layers` that also keeps the first and last Linear layers of `module` unconverted."""
    return filter_linear_layers(module, fqn, layers_to_filter=list(find_first_last_linear_layers(module)))


def _has_layers(model: torch.nn.Module, package: str, *paths: str) -> bool:
    """Whether `model` holds an instance of `package.<path>` classes; False when `package` was never imported
    (no module of it can exist then, and importing it would be slow or initialize devices)."""
    if package not in sys.modules:
        return False
    classes = []
    for path in paths:
        module_name, _, name = path.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(f"{package}.{module_name}".rstrip(".")), name))
        except (ImportError, AttributeError):
            continue
    return bool(classes) and any(isinstance(module, tuple(classes)) for module in model.modules())


def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether `model` holds torchao `Float8Linear` layers."""
    return _has_layers(model, "torchao", "float8.float8_linear.Float8Linear")


def convert_model_to_fp8_ao(model: torch.nn.Module, config: Any = None, module_filter_func: Callable | None = None):
    """Converting Linear layers to torchao's Float8Linear: refused."""
    raise _refuse("torchao", "convert_model_to_fp8_ao(model)")


# --- utils.transformer_engine -------------------------------------------------------------------------------------


def has_transformer_engine_layers(model: torch.nn.Module) -> bool:
    """Whether `model` holds TransformerEngine layers (LayerNorm, Linear, TransformerLayer)."""
    return _has_layers(model, "transformer_engine", "pytorch.LayerNorm", "pytorch.Linear", "pytorch.TransformerLayer")


def convert_model(
    model: torch.nn.Module, to_transformer_engine: bool = True, _convert_linear: bool = True, _convert_ln: bool = True
) -> None:
    """Swapping Linear/LayerNorm layers for TransformerEngine's: refused."""
    raise _refuse("TransformerEngine", "convert_model(model)")


def contextual_fp8_autocast(model_forward: Callable, fp8_recipe: Any, use_during_eval: bool = False) -> Callable:
    """A forward under TransformerEngine's fp8_autocast: refused."""
    raise _refuse("TransformerEngine", "contextual_fp8_autocast(...)")


def apply_fp8_autowrap(model: torch.nn.Module, fp8_recipe_handler: Any) -> torch.nn.Module:
    """Wrapping a model's forward in TransformerEngine's fp8_autocast: refused."""
    raise _refuse("TransformerEngine", "apply_fp8_autowrap(model, ...)")


__all__ = [
    "AORecipeKwargs",
    "AmaxComputeAlgorithm",
    "Backend",
    "FP8Format",
    "OptLevel",
    "FP8RecipeKwargs",
    "MSAMPRecipeKwargs",
    "RECIPE_HANDLERS",
    "TERecipeKwargs",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
    "has_transformer_engine_layers",
]
