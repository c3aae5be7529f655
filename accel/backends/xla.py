"""TPU / XLA's names (accel does not run on TPUs)."""

from __future__ import annotations

from accel.backends import DDP_INSTEAD
from accel.unsupported import refuse


def install_xla(upgrade: bool = False) -> None:
    """HF Accelerate installs torch_xla wheels on Colab here; accel runs no XLA device, so this is refused."""
    raise refuse("TPU/XLA", f"install_xla(upgrade={upgrade})", DDP_INSTEAD)


__all__ = ["install_xla"]
