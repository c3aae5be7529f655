"""What each rank runs under `accel launch`: the user's script or module, with its traceback recorded.

torch's elastic agent reads the error file that @record writes, so the launcher's failure summary shows
the failing rank's traceback, not just an exit code.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import record


def die_with_launcher() -> None:
    """A launcher killed with SIGKILL cannot stop its ranks; the kernel does it for us (Linux only)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@record
def main(argv: list[str]) -> None:
    die_with_launcher()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would set it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
