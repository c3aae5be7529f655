"""Ranks as separate spawned processes, outside the spawn pool: for tests that kill a rank on purpose (the pool's
fail-fast would stop the survivors before they report)."""

from __future__ import annotations

import multiprocessing
import time
from typing import Callable

from spawn_pool import free_port


def run_separate_ranks(target: Callable, world_size: int, *args, timeout: float = 90.0) -> tuple[list, list[int]]:
    """Runs `target(rank, world_size, port, *args)` in `world_size` spawned processes (module-level `target`) and
    waits for all of them within `timeout` seconds; kills those still running then.

    Returns:
        (the processes, joined, with their exit codes; the pids of those that had to be killed).
    """
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [
        context.Process(target=target, args=(rank, world_size, port, *args), daemon=True) for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [process.pid for process in ranks if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    return ranks, hung
