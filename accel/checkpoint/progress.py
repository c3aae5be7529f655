"""A progress bar for large saves and loads: tqdm, on the main process, from PROGRESS_THRESHOLD bytes on.

It advances per file (a shard is written or read by one native call), so it shows for sharded checkpoints
of a GiB and more, where waiting is long enough to wonder. `ACCEL_DISABLE_PROGRESS=1`, or `progress=False`
where a function takes it, turns it off; `progress=True` forces it on. Without tqdm there is no bar.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

PROGRESS_THRESHOLD = 1 << 30


class _NoBar:
    def update(self, n: int) -> None:
        pass


def _wanted(total_bytes: int, progress: bool | None) -> bool:
    if progress is not None:
        return progress
    disabled = os.environ.get("ACCEL_DISABLE_PROGRESS", "").strip().lower() in ("1", "true", "yes", "on")
    main_process = os.environ.get("RANK", "0") == "0"
    return not disabled and main_process and total_bytes >= PROGRESS_THRESHOLD


@contextlib.contextmanager
def progress_bar(total_bytes: int, description: str, progress: bool | None = None) -> Iterator[Any]:
    """Yields an object with `update(bytes)`: a tqdm bar when wanted (see the module docstring), else a no-op."""
    if not _wanted(total_bytes, progress):
        yield _NoBar()
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield _NoBar()
        return
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=description) as bar:
        yield bar
