"""Accelerator.profile: torch.profiler with ProfileKwargs, Chrome traces under HF Accelerate's file names."""

from __future__ import annotations

import json

import pytest
import torch
from spawn_pool import run_on_ranks

from accel import Accelerator
from accel.accelerator_config import ProfileKwargs


def _work():
    a = torch.randn(16, 16)
    return (a @ a).sum()


def test_profile_records_and_writes_a_chrome_trace(tmp_path):
    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "trace"))
    accelerator = Accelerator(kwargs_handlers=[handler])
    assert accelerator.profile_handler is handler
    with accelerator.profile() as profiler:
        _work()
    assert "aten::mm" in {event.key for event in profiler.key_averages()}
    trace = json.loads((tmp_path / "trace" / "profile_0.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])


def test_a_handler_passed_to_profile_overrides_and_schedules(tmp_path):
    ready = []
    handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 1}, on_trace_ready=ready.append)
    accelerator = Accelerator(kwargs_handlers=[ProfileKwargs(output_trace_dir=str(tmp_path / "unused"))])
    with accelerator.profile(handler) as profiler:
        for _ in range(4):
            _work()
            profiler.step()
    assert ready == [profiler]  # one active step recorded, then handed over
    assert not (tmp_path / "unused").exists()  # the Accelerator's own handler was not used


def test_bad_activity_names_the_choices():
    with pytest.raises(ValueError, match=r"Invalid profiler activity: gpu. Must be one of \['cpu', 'cuda'"):
        ProfileKwargs(activities=["gpu"]).build()


def _profile_on_rank(trace_dir):
    accelerator = Accelerator()
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=trace_dir)):
        _work()
    return accelerator.process_index


def test_each_process_writes_its_own_trace(tmp_path):
    assert run_on_ranks(_profile_on_rank, 2, str(tmp_path)) == [0, 1]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["profile_0.json", "profile_1.json"]
