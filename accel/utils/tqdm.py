"""`accelerate.utils.tqdm` import path: re-exports."""

from accel.availability import is_tqdm_available
from accel.logging import tqdm
from accel.state import PartialState

__all__ = ["PartialState", "is_tqdm_available", "tqdm"]
