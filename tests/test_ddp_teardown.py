"""A DDP model freed after `end_training` releases its gloo process group without deadlocking.

torch frees DDP's C++ Reducer with the GIL held; when the Reducer held the group's last reference, gloo's destructor
joined a worker thread that was waiting for the GIL to release the last gradient all-reduce, and the rank hung for
good (CI: a tracking test's rank 1 timed out in the fallback and pure-install suites; gdb showed the main thread in
`~ProcessGroupGloo` under `~Reducer` and a `pt_gloo_runloop` thread in `take_gil`). accel's DDP strategy makes the
Python `ProcessGroup`, which torch frees with the GIL released, the last reference (`accel.strategies.ddp`).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from spawn_pool import free_port, run_on_ranks

CYCLES = 30


def _train_end_and_free(ports: list[int]) -> int:
    from accel import Accelerator
    from accel.state import AcceleratorState, GradientState, PartialState

    # The main thread keeps the GIL until it blocks, so a gloo worker that needs it to finish releasing a work is
    # still waiting when the module is freed: without the fix every run hung in the first cycles.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        for port in ports:  # a store of its own per cycle: rank 0's previous one may still be closing
            os.environ["MASTER_PORT"] = str(port)
            accelerator = Accelerator()
            model = accelerator.prepare(torch.nn.Linear(2, 1))
            model(torch.ones(4, 2)).sum().backward()
            accelerator.end_training()  # destroys the process group; the DDP module still references it
            del model, accelerator
            PartialState._reset_state()
            AcceleratorState._reset_state()
            GradientState._reset_state()
    finally:
        sys.setswitchinterval(interval)
    return len(ports)


@pytest.mark.timeout(150)
def test_a_ddp_model_freed_after_end_training_releases_its_gloo_group(monkeypatch):
    monkeypatch.setenv("ACCEL_TRANSPORT", "torch")  # plain gloo in every mode (natively, CPU groups share memory)
    ports: set[int] = set()
    while len(ports) < CYCLES:
        ports.add(free_port())
    assert run_on_ranks(_train_end_and_free, 2, sorted(ports), timeout=90) == [CYCLES, CYCLES]


def test_the_ddp_module_drops_its_process_group_reference_last():
    from accel.strategies.ddp import _release_group_after_reducer

    class Module:  # DDP's attribute order: the group before the Reducer that also holds it
        pass

    module = Module()
    module.logger, module.process_group, module.reducer = "logger", "group", "reducer"
    _release_group_after_reducer(module)
    assert list(vars(module)) == ["logger", "reducer", "process_group"]
