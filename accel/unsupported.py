"""One clear refusal for the backends accel does not run (DeepSpeed, Megatron-LM, FP8 engines, TPU/XLA, ...).

HF Accelerate's names for them exist in accel, so scripts import and configs load; *using* one raises
`UnsupportedFeatureError` at `Accelerator(...)` or `accel launch`, naming the feature, what asked for it (the
argument, flag, config key or environment variable) and what accel supports instead. Never a silent ignore.

Torch-free, so the CLI can refuse without importing torch.
"""

from __future__ import annotations


class UnsupportedFeatureError(NotImplementedError):
    """A feature of HF Accelerate that accel does not run.

    Attributes:
        feature: what was asked for ("DeepSpeed", "FP8 training", ...).
        asked_by: the argument, flag, config key or variable that asked for it.
        instead: what accel supports instead.
    """

    def __init__(self, feature: str, asked_by: str, instead: str):
        super().__init__(f"{feature} is not supported by accel (asked for by {asked_by}). {instead}")
        self.feature = feature
        self.asked_by = asked_by
        self.instead = instead


def refuse(feature: str, asked_by: str, instead: str) -> UnsupportedFeatureError:
    """The error to raise; `raise refuse("DeepSpeed", "deepspeed_plugin=...", "Use DDP: ...")`."""
    return UnsupportedFeatureError(feature, asked_by, instead)
