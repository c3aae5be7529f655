"""`accelerate.utils.versions` import path: re-exports of accel.availability's version checks."""

from accel import availability
from accel.availability import STR_OPERATION_TO_FUNC, compare_versions, is_torch_version

# torch_version is served by __getattr__ below (read when asked, as HF's module constant is)
__all__ = ["STR_OPERATION_TO_FUNC", "compare_versions", "is_torch_version", "torch_version"]  # noqa: F822


def __getattr__(name):
    if name == "torch_version":  # HF's module constant: the installed torch's version
        return availability.torch_version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
