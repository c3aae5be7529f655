"""Runs pytest in every rank of `accel launch`; only rank 0 reports (the others' tables would repeat it).

    accel launch --cpu --num_processes 2 benchmarks/ranked_pytest.py benchmarks/bench_gather.py --benchmark-only

The other ranks' stdout goes to /dev/null before pytest starts (it saves the descriptor it writes to), and
they write no --benchmark-json; their errors still reach stderr.
"""

import os
import sys

import pytest

if __name__ == "__main__":
    args = sys.argv[1:]
    if int(os.environ.get("RANK", "0")) != 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        args = [arg for arg in args if not arg.startswith("--benchmark-json")]
    sys.exit(pytest.main(args))
