"""bitsandbytes quantization's names (accel does not quantize): the config validates; quantizing is refused."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from accel.accelerator_config import CustomDtype
from accel.unsupported import refuse

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype(value: Any, field: str) -> torch.dtype:
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ValueError(f"{field} must be in ['fp32','fp16','bf16'] but found {value}")
        return _DTYPES[value]
    return value


@dataclasses.dataclass
class BnbQuantizationConfig:
    """HF Accelerate's bitsandbytes 4-bit / 8-bit quantization settings, validated as HF does.

    Exactly one of `load_in_8bit` / `load_in_4bit` must be True. `bnb_4bit_compute_dtype` and `torch_dtype`
    take "fp32" / "fp16" / "bf16" or a dtype; `torch_dtype` defaults to float16 (8-bit) or the compute dtype
    (4-bit). `target_dtype` is `torch.int8` or `CustomDtype.INT4`.
    """

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: Any = None
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit can't be both True")
        if not self.load_in_4bit and not self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit can't be both False")
        if self.bnb_4bit_quant_type not in ("fp4", "nf4"):
            raise ValueError(f"bnb_4bit_quant_type must be in ['fp4','nf4'] but found {self.bnb_4bit_quant_type}")
        self.bnb_4bit_compute_dtype = _dtype(self.bnb_4bit_compute_dtype, "bnb_4bit_compute_dtype")
        if not isinstance(self.bnb_4bit_compute_dtype, torch.dtype):
            raise ValueError("bnb_4bit_compute_dtype must be a string or a torch.dtype")
        self.target_dtype = CustomDtype.INT4 if self.load_in_4bit else torch.int8
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            warnings.warn("llm_int8_threshold can only be used for model loaded in 8bit")
        self.torch_dtype = _dtype(self.torch_dtype, "torch_dtype")
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        if not isinstance(self.torch_dtype, torch.dtype):
            raise ValueError("torch_dtype must be a torch.dtype")

    def _check_types(self) -> None:
        checks = [
            ("load_in_8bit", bool, "a boolean"),
            ("load_in_4bit", bool, "a boolean"),
            ("llm_int8_threshold", (int, float), "a float or an int"),
            ("bnb_4bit_quant_type", str, "a string"),
            ("bnb_4bit_use_double_quant", bool, "a boolean"),
        ]
        for name, types, what in checks:
            if not isinstance(getattr(self, name), types):
                raise ValueError(f"{name} must be {what}")
        for name in ("skip_modules", "keep_in_fp32_modules"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list of strings")


def has_4bit_bnb_layers(model: torch.nn.Module) -> bool:
    """Whether `model` holds bitsandbytes `Linear4bit` layers (False when bitsandbytes was never imported: no
    such layer can exist then, and importing it would initialize the GPU)."""
    import sys

    bnb = sys.modules.get("bitsandbytes")
    linear4bit = getattr(getattr(bnb, "nn", None), "Linear4bit", None)
    return linear4bit is not None and any(isinstance(module, linear4bit) for module in model.modules())


def load_and_quantize_model(
    model: torch.nn.Module,
    bnb_quantization_config: BnbQuantizationConfig,
    weights_location: Any = None,
    device_map: Any = None,
    no_split_module_classes: Any = None,
    max_memory: Any = None,
    offload_folder: Any = None,
    offload_state_dict: bool = False,
):
    """Quantizing a model with bitsandbytes: refused."""
    raise refuse(
        "bitsandbytes quantization",
        "load_and_quantize_model(model, bnb_quantization_config)",
        "accel loads full-precision weights: use load_checkpoint_and_dispatch, and bf16/fp16 to save memory.",
    )


__all__ = ["BnbQuantizationConfig", "has_4bit_bnb_layers", "load_and_quantize_model"]
