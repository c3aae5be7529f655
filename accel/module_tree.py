"""A model's module tree: the user's model inside the wrappers accel and torch put around it, and walks over it.

`extract_model_from_parallel` is the one unwrapping implementation (`Accelerator.unwrap_model` and `is_peft_model`
use it): it removes torch.compile's wrapper (kept or not), DistributedDataParallel / DataParallel / FSDP (and
DeepSpeed's engine, when DeepSpeed is imported), and optionally the mixed-precision forward accel installs.
"""

from __future__ import annotations

import functools
import sys
from types import MethodType
from typing import Any

import torch

from accel.availability import is_peft_available
from accel.compilation import has_compiled_regions, is_compiled_module
from accel.precision import restore_forward


def _parallel_wrappers() -> tuple[type, ...]:
    """The classes whose `.module` is the model they distribute."""
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    # Only modules already imported can have wrapped the model; importing them here would only cost time.
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is not None:
        wrappers += (fsdp.FullyShardedDataParallel,)
    if "deepspeed" in sys.modules and hasattr(sys.modules["deepspeed"], "DeepSpeedEngine"):
        wrappers += (sys.modules["deepspeed"].DeepSpeedEngine,)
    return wrappers


def _outer_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module]:
    """(the compile wrapper around `model` or None, the module it wraps)."""
    if is_compiled_module(model):
        return model, model._orig_mod
    if has_compiled_regions(model) and "_orig_mod" in model.__dict__:  # compile_regions' result
        return model, model.__dict__["_orig_mod"]
    return None, model


def _unwrap_every_level(module: Any) -> Any:
    """HF's recursive unwrap: `.module` taken wherever a module has one, then the same for each child."""
    if hasattr(module, "module"):
        module = _unwrap_every_level(module.module)
    for name, child in module.named_children():
        setattr(module, name, _unwrap_every_level(child))
    return module


def _remove_mixed_precision_forward(model: torch.nn.Module) -> None:
    """Gives `model` back the forward it had before mixed precision wrapped it: accel's autocast forward, or a
    forward HF-style code wrapped with `convert_outputs_to_fp32` after saving it as `_original_forward`."""
    restore_forward(model)
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    forward = model.forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
        if forward == original:
            break
    model.forward = MethodType(forward, model)


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> torch.nn.Module:
    """The user's model inside its distributed wrappers (DDP, DataParallel, FSDP, DeepSpeed's engine).

    Args:
        model: A prepared model.
        keep_fp32_wrapper: Keep the mixed-precision forward (autocast, outputs upcast to fp32); False restores the
            model's own forward.
        keep_torch_compile: When `model` is compiled (`torch.compile` or `compile_regions`, around or inside the
            distributed wrapper), return the (outermost) compiled wrapper around the unwrapped model (as HF: the
            wrapper's `_orig_mod` is replaced by the unwrapped model); False returns the plain model. HF leaves a
            compile wrapper inside DDP in place even then, and cannot remove the mixed-precision forward under it.
        recursive: Also unwrap every `.module` found anywhere below (HF's FSDP-on-XLA case).

    Returns:
        The unwrapped model (or its compiled wrapper, see `keep_torch_compile`).

    Example::

        prepared = accelerator.prepare(model)          # DDP(model) under `accel launch`
        extract_model_from_parallel(prepared) is model  # True
    """
    compiled, model = _outer_compiled(model)
    wrappers = _parallel_wrappers()
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif is_compiled_module(model):  # compiled inside DDP (accel does that for fullgraph compilation)
            compiled = compiled or model
            model = model._orig_mod
        else:
            break
    if recursive:
        model = _unwrap_every_level(model)
    if not keep_fp32_wrapper:
        _remove_mixed_precision_forward(model)
    if keep_torch_compile and compiled is not None:
        if is_compiled_module(compiled):
            compiled._orig_mod = model
        else:
            compiled.__dict__["_orig_mod"] = model
        return compiled
    return model


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether `model` (possibly wrapped by DDP or torch.compile) is a PEFT `PeftModel`; False without peft
    installed (peft is imported only when it is)."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def recursive_getattr(obj: Any, attr: str) -> Any:
    """`getattr` along a dotted path: `recursive_getattr(model, "encoder.layer.0.weight")`."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_module_children_bottom_up(
    model: torch.nn.Module, return_fqns: bool = False
) -> list[torch.nn.Module] | list[tuple[str, torch.nn.Module]]:
    """Every module of `model`, each after all of its descendants; `model` itself last.

    Args:
        model: The model to walk.
        return_fqns: Return `(fully qualified name, module)` pairs (`""` for `model`).

    Returns:
        The modules (or pairs) in bottom-up order: the reverse of a depth-first walk that visits children last
        to first (HF's order, which FSDP2's wrapping relies on).
    """
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    ordered = []
    while stack:
        name, module = stack.pop()
        ordered.append((name, module))
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    ordered.reverse()
    return ordered if return_fqns else [module for _, module in ordered]


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (the model is sharded by FSDP2 or tensor parallelism)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:  # no DTensor can exist before torch.distributed.tensor is imported
        return False
    return any(isinstance(parameter, tensor_module.DTensor) for parameter in model.parameters())


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """The tensor-parallel degree a `transformers` model was sharded with, or None.

    transformers < 5 records it as `model.tp_size`; transformers 5 in `model.config.distributed_config`.
    """
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return tp_size
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed_config, dict):
        return distributed_config.get("tp_size")
    return getattr(distributed_config, "tp_size", None)
