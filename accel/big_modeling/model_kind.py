"""What kind of model a module is, for code that treats some kinds differently: `is_peft_model`."""

from __future__ import annotations

import importlib.util

from torch import nn


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile's and DDP's wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` (possibly wrapped by DDP or torch.compile) is a PEFT `PeftModel`; False without peft
    installed (peft is imported only when it is)."""
    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(_unwrapped(model), PeftModel)
