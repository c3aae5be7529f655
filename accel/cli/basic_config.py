"""`basic_config` / `write_basic_config`: HF Accelerate's one-call config for this machine, behind `accel config
default` (HF's path, `accel.utils.write_basic_config`, re-exports it)."""

from __future__ import annotations

import os
from pathlib import Path

from accel.cli.config_file import ClusterConfig, default_config_path, save_config
from accel.env_vars import MIXED_PRECISIONS


def basic_config(mixed_precision: str = "no") -> ClusterConfig:
    """The config HF Accelerate's `write_basic_config` describes for this machine.

    Several CUDA devices give MULTI_GPU with one process per device; one device gives NO; no device gives NO
    with `use_cpu: true`.

    Args:
        mixed_precision: one of "no", "fp16", "bf16", "fp8" (any case).

    Returns:
        The config (not saved).

    Raises:
        ValueError: `mixed_precision` is not an allowed value.
    """
    mixed_precision = mixed_precision.lower()
    if mixed_precision not in MIXED_PRECISIONS:
        allowed = ", ".join(repr(value) for value in MIXED_PRECISIONS)
        raise ValueError(f"`mixed_precision` should be one of {allowed}. Received {mixed_precision!r}.")
    gpus = _cuda_device_count()
    return ClusterConfig(
        distributed_type="MULTI_GPU" if gpus > 1 else "NO",
        mixed_precision=mixed_precision,
        use_cpu=gpus == 0,
        num_processes=max(gpus, 1),
        debug=False,
        enable_cpu_affinity=False,
    )


def _cuda_device_count() -> int:
    # Imported here so that `accel config` and config loading never pay for importing torch.
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike | None = None, use_xpu: bool = False
) -> Path | bool:
    """Create and save a basic config for this machine, unless a file is already there.

    Args:
        mixed_precision: one of "no", "fp16", "bf16", "fp8".
        save_location: where to write; defaults to `default_config_path()`, resolved at call time (HF
            Accelerate resolves its default at import time, so later changes to `HF_HOME` are missed).
        use_xpu: accepted for compatibility with HF Accelerate 0.2x; accel does not drive Intel XPUs, so it
            changes nothing.

    Returns:
        The path written, or False when a file already exists there (it is left untouched, as HF does).

    Raises:
        ValueError: `mixed_precision` is not an allowed value.
        ConfigError: the file cannot be written.
    """
    del use_xpu
    path = Path(save_location if save_location is not None else default_config_path()).expanduser()
    if path.exists():
        print(
            f"Configuration already exists at {path}, will not override. Run `accel config` manually or pass a "
            "different `save_location`."
        )
        return False
    return save_config(basic_config(mixed_precision), path)
