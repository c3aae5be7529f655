"""torch.compile of whole models and of their repeated blocks ("regional compilation").

Regional compilation compiles each block of a `ModuleList` whose children all have one class (a transformer's
layers) separately: they share one compiled graph through the compiler's cache, so a model with 48 identical
layers compiles about as fast as one layer. Everything outside the repeated blocks is compiled as a whole.
See https://pytorch.org/tutorials/recipes/regional_compilation.html.
"""

from __future__ import annotations

import sys
from types import MethodType

import torch


def _optimized_module_type() -> type | None:
    # A compiled module can only exist once torch._dynamo has been imported; importing it just to answer "no"
    # would cost the caller a second or more.
    if "torch._dynamo" not in sys.modules:
        return None
    return sys.modules["torch._dynamo"].eval_frame.OptimizedModule


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether `module` is the wrapper `torch.compile(module)` returns."""
    optimized = _optimized_module_type()
    return optimized is not None and isinstance(module, optimized)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether `module` (if it has children) or any module below it is a `torch.compile` wrapper."""
    optimized = _optimized_module_type()
    if optimized is None or not module._modules:
        return False
    return any(isinstance(submodule, optimized) for submodule in module.modules())


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether `module` is a non-empty `ModuleList` whose children are all instances of its first child's class."""
    return (
        isinstance(module, torch.nn.ModuleList)
        and len(module) > 0
        and all(isinstance(child, module[0].__class__) for child in module)
    )


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether `module` or any module below it is a list of repeated blocks (`is_repeated_blocks`)."""
    return bool(module._modules) and any(is_repeated_blocks(submodule) for submodule in module.modules())


def _shell_of(module: torch.nn.Module) -> torch.nn.Module:
    """A new instance of `module`'s class sharing its attributes, parameters and buffers but without children.

    Methods bound to `module` in its instance dict (a patched `forward`, such as accel's mixed-precision forward)
    are bound to the new instance instead, so calling it runs on the new instance's (compiled) children.
    """
    shell = module.__class__.__new__(module.__class__)
    shell.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is module:
            shell.__dict__[name] = MethodType(value.__func__, shell)
    shell._modules = {}
    return shell


def _compiled_regions_of(module: torch.nn.Module, compile_kwargs: dict) -> torch.nn.Module:
    if is_repeated_blocks(module):
        return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if not has_repeated_blocks(module):
        return torch.compile(module, **compile_kwargs)
    shell = _shell_of(module)
    for name, child in module.named_children():
        shell.add_module(name, _compiled_regions_of(child, compile_kwargs))
    return shell


def compile_regions(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Compiles the repeated blocks of `module` one by one and the rest of it as a whole (regional compilation).

    `module` itself is left as it is: the result is a new module of the same class sharing its parameters and
    buffers, whose lists of repeated blocks hold `torch.compile`d blocks. The original is kept as
    `result._orig_mod`, so `extract_model_from_parallel` / `Accelerator.unwrap_model` return it. A module without
    repeated blocks is compiled as a whole (`torch.compile(module)`).

    Args:
        module: The model.
        **compile_kwargs: Passed to each `torch.compile` call (`backend`, `mode`, `fullgraph`, `dynamic`, ...).

    Returns:
        The model with compiled regions.

    Example::

        compiled = compile_regions(gpt2, mode="reduce-overhead")
        compiled.transformer.h[0]          # OptimizedModule((_orig_mod): GPT2Block(...))
        compiled._orig_mod is gpt2         # True
    """
    compiled = _compiled_regions_of(module, compile_kwargs)
    if "_orig_mod" not in compiled.__dict__:
        compiled.__dict__["_orig_mod"] = module
    return compiled


def compile_regions_in_place(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Regional compilation with `nn.Module.compile()`, which compiles a module in place: the model keeps its
    module tree and `nn.Module.__call__`, so hooks installed later (DeepSpeed's, FSDP2's `fully_shard`) still run.

    Args:
        module: The model; its repeated blocks, and the modules without repeated blocks below it, are compiled.
        **compile_kwargs: Passed to each `module.compile()` call.

    Returns:
        `module` itself.
    """
    if is_repeated_blocks(module):
        for block in module:
            block.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            compile_regions_in_place(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)
    return module


def compile_regions_deepspeed(module: torch.nn.Module, **compile_kwargs) -> None:
    """HF's regional compilation of a `DeepSpeedEngine.module`: `compile_regions_in_place`, which needs no
    DeepSpeed and works on any module (accel itself does not run DeepSpeed). Returns None, as HF's."""
    compile_regions_in_place(module, **compile_kwargs)


def compile_regions_fsdp2(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """HF's regional compilation for FSDP2 (compile, then `fully_shard`): `compile_regions_in_place`, which needs
    no FSDP and works on any module. Returns `module`."""
    return compile_regions_in_place(module, **compile_kwargs)
