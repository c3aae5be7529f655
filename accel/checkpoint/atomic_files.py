"""Files that appear complete or not at all: written under a temporary name, fsync'd, renamed into place.

(`temporary_name` and `fsync_directory` still live in safetensors_io.py, whose native writer uses them too.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO

from accel.checkpoint.safetensors_io import fsync_directory, temporary_name


def write_atomically(path: str, write: Callable[[IO], None], mode: str = "wb") -> None:
    """Calls `write(file)` on a temporary file next to `path`, fsyncs it and renames it over `path`.

    A reader sees the old file or the complete new one, never a part; a crash leaves at most a temporary file
    (`.NAME.tmp-PID-RANDOM`), which is removed when `write` raises.

    Args:
        path: The file to (re)place.
        write: Writes the content into the open file it is given.
        mode: The mode the temporary file is opened with ("wb", or "w" for text).
    """
    temporary = temporary_name(path)
    try:
        with open(temporary, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_directory(os.path.dirname(path) or ".")
