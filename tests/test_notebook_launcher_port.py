"""notebook_launcher(use_port="0") leaves no window in which another process can take its port (issue 12).

Picking a free port, closing it and binding it again later is a race: here the race is lost on purpose (the
port the old way would pick is taken before the launch), and the launch must still succeed.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from accel import environment, launchers
from accel.launchers import notebook_launcher
from accel.state import PartialState

pytestmark = pytest.mark.timeout(120)


def _report_rank(out_dir: str) -> None:
    state = PartialState()
    total = torch.tensor([state.process_index + 1])
    dist.all_reduce(total)
    with open(os.path.join(out_dir, f"rank{state.process_index}"), "w") as file:
        file.write(f"{total.item()} {os.environ['MASTER_PORT']}")


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the CPU path: launched processes would take the GPUs")
def test_use_port_0_survives_another_process_taking_the_picked_port(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # What a port picked by bind/close would run into: someone else listens there by the time it is used.
        monkeypatch.setattr(environment, "get_free_port", lambda *args, **kwargs: port)
        monkeypatch.setattr(launchers, "get_free_port", lambda *args, **kwargs: port, raising=False)
        notebook_launcher(_report_rank, args=(str(tmp_path),), num_processes=2, use_port="0", monitor_interval=0.05)
    reports = [(tmp_path / f"rank{rank}").read_text().split() for rank in range(2)]
    assert [total for total, _ in reports] == ["3", "3"]
    assert {master_port for _, master_port in reports} != {str(port)}
