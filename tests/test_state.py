"""accel.state: PartialState, AcceleratorState, GradientState and DistributedType.

Single-process behaviour runs in the test process; multi-process behaviour runs on 1, 2 and 4 gloo ranks through
the spawn pool of tests/spawn_pool.py (4 ranks oversubscribe the 2 CI cores on purpose).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from spawn_pool import run_on_ranks

from accel import state as state_module
from accel.state import AcceleratorState, DistributedType, GradientState, PartialState, is_initialized
from accel.unsupported import UnsupportedFeatureError

WORLD_SIZES = [1, 2, 4]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch):
    """The test process itself is never "launched", whatever the shell running pytest exports."""
    for name in LAUNCH_ENV + ("ACCEL_USE_CPU", "ACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)


# --- HF Accelerate's split arithmetic, the reference -------------------------------------------------------------


def _hf_indices(length: int, world_size: int, rank: int, apply_padding: bool) -> list[int]:
    """The indices HF Accelerate's split_between_processes hands to `rank` (empty inputs stay empty)."""
    if world_size == 1:
        return list(range(length))
    per_process, extras = divmod(length, world_size)
    start = rank * per_process + min(rank, extras)
    end = start + per_process + (1 if rank < extras else 0)
    indices = list(range(start, end))
    if apply_padding and length:
        indices += [length - 1] * (per_process + (1 if extras > 0 else 0) - len(indices))
    return indices


def _split_cases(length: int) -> dict[str, object]:
    letters = [chr(ord("a") + i) for i in range(length)]
    return {
        "list": letters,
        "tuple": tuple(letters),
        "tensor": torch.arange(length * 2).reshape(length, 2),
        "dict": {"text": list(letters), "ids": torch.arange(length), "nested": {"pair": tuple(letters)}},
    }


def _expected_split(case: str, length: int, indices: list[int]):
    full = _split_cases(length)[case]
    if case == "dict":
        return {
            "text": [full["text"][i] for i in indices],
            "ids": full["ids"][indices],
            "nested": {"pair": tuple(full["nested"]["pair"][i] for i in indices)},
        }
    if case == "tensor":
        return full[indices] if indices else full[:0]
    return type(full)(full[i] for i in indices)


def _assert_same(actual, expected):
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape and torch.equal(actual, expected)
    else:
        assert actual == expected


def test_split_matches_hf_arithmetic_as_a_pure_function():
    for world_size in range(1, 5):
        for rank in range(world_size):
            for length in range(10):
                for padding in (False, True):
                    indices = _hf_indices(length, world_size, rank, padding)
                    for case, inputs in _split_cases(length).items():
                        actual = state_module._split_inputs(inputs, world_size, rank, padding)
                        _assert_same(actual, _expected_split(case, length, indices))


def test_split_shares_are_contiguous_and_cover_everything():
    for world_size in range(1, 5):
        for length in range(10):
            shares = [state_module._shard_bounds(length, world_size, rank) for rank in range(world_size)]
            assert shares[0][0] == 0 and shares[-1][1] == length
            assert all(shares[i][1] == shares[i + 1][0] for i in range(world_size - 1))
            sizes = [end - start for start, end in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_docstring_example():
    assert state_module._split_inputs(["A", "B", "C"], 2, 0) == ["A", "B"]
    assert state_module._split_inputs(["A", "B", "C"], 2, 1) == ["C"]
    assert state_module._split_inputs(["A", "B", "C"], 2, 1, apply_padding=True) == ["C", "C"]


def test_split_dict_needs_equal_lengths_and_is_not_modified():
    inputs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    assert state_module._split_inputs(inputs, 2, 1) == {"a": [3, 4], "b": [7, 8]}
    assert inputs == {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    with pytest.raises(ValueError, match="same length.*'a': 2, 'b': 3"):
        state_module._split_inputs({"a": [1, 2], "b": [1, 2, 3]}, 2, 0)


def test_split_passes_other_types_through_whole():
    assert state_module._split_inputs("abcd", 2, 1) == "abcd"
    assert state_module._split_inputs({"text": "abcd", "ids": [1, 2, 3, 4]}, 2, 1) == {"text": "abcd", "ids": [3, 4]}


def test_split_padding_keeps_tensor_dtype_and_device():
    inputs = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)
    padded = state_module._split_inputs(inputs, 2, 1, apply_padding=True)
    assert padded.dtype == torch.bfloat16 and padded.tolist() == [3.5, 3.5]


# --- One process, no launcher --------------------------------------------------------------------------------------


def test_single_process_state():
    state = PartialState()
    assert state.distributed_type == DistributedType.NO
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.backend is None
    cuda = torch.cuda.is_available()
    assert state.device == (torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed and not state.debug
    assert state.timeout == dist.default_pg_timeout
    assert not dist.is_initialized()
    state.wait_for_everyone()
    assert "Num processes: 1" in repr(state) and "Distributed environment: " in repr(state)


def test_state_is_shared_and_resettable():
    first = PartialState()
    assert PartialState().__dict__ is first.__dict__ and first.initialized
    PartialState._reset_state()
    assert not first.initialized
    with pytest.raises(AttributeError, match="_reset_state"):
        first.device
    with pytest.raises(AttributeError, match="no attribute 'unknown'"):
        first.unknown


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CPU-only machine that claims one CUDA device (only device resolution is exercised)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cuda_is_the_single_process_device_when_available(fake_cuda):
    assert PartialState().device == torch.device("cuda", 0)


def test_cpu_argument_forces_the_cpu(fake_cuda):
    assert PartialState(cpu=True).device == torch.device("cpu")


def test_use_cpu_env_forces_the_cpu(fake_cuda, monkeypatch):
    monkeypatch.setenv("ACCEL_USE_CPU", "1")
    assert PartialState().device == torch.device("cpu")


def test_torch_device_env_overrides(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "meta")
    assert PartialState().device == torch.device("meta")


def test_debug_mode_from_env(monkeypatch):
    monkeypatch.setenv("ACCEL_DEBUG_MODE", "1")
    assert PartialState().debug


def test_timeout_from_kwarg_then_env(monkeypatch):
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "17")
    assert PartialState(timeout=timedelta(seconds=42)).timeout == timedelta(seconds=42)
    PartialState._reset_state()
    assert PartialState().timeout == timedelta(seconds=17)


def test_bad_timeout_env_names_the_variable_and_leaves_state_uninitialized(monkeypatch):
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ACCEL_PROCESS_GROUP_TIMEOUT='soon'"):
        PartialState()
    assert PartialState._shared_state == {}


def test_single_process_decorators_and_print(capsys):
    state = PartialState()
    ran = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_local_main_process(lambda: ran.append("local_main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=3)(lambda: ran.append("process 3"))()
    state.on_local_process(local_process_index=3)(lambda: ran.append("local 3"))()
    assert ran == ["main", "local_main", "last", "process 3", "local 3"]
    state.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


def test_on_main_process_needs_an_initialized_state():
    state = PartialState()
    PartialState._reset_state()
    with pytest.raises(ValueError, match="must be initialized"):
        state.on_main_process(print)


def test_single_process_split_returns_inputs_unchanged():
    inputs = [1, 2, 3]
    with PartialState().split_between_processes(inputs, apply_padding=True) as shard:
        assert shard is inputs


def test_distributed_type_is_a_json_friendly_str_enum():
    assert DistributedType.MULTI_CPU == "MULTI_CPU"
    assert json.dumps({"type": DistributedType.MULTI_GPU}) == '{"type": "MULTI_GPU"}'
    expected = {
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_HPU",
        "MULTI_XPU",
        "DEEPSPEED",
        "FSDP",
        "XLA",
        "MEGATRON_LM",
        "TP",
    }
    assert expected <= {member.value for member in DistributedType}


# --- AcceleratorState ----------------------------------------------------------------------------------------------


def test_accelerator_state_must_come_from_an_accelerator():
    with pytest.raises(ValueError, match="Accelerator()"):
        AcceleratorState()
    assert not is_initialized() and AcceleratorState._shared_state == {}


def test_accelerator_state_defaults_and_forwarding():
    state = AcceleratorState(_from_accelerator=True)
    assert state.initialized and is_initialized()
    assert state.mixed_precision == "no" and state.dynamo_plugin is None and state.deepspeed_plugin is None
    partial_state = PartialState()
    assert state.device == partial_state.device and state.num_processes == 1
    assert state.distributed_type == DistributedType.NO
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.timeout == partial_state.timeout and not state.use_distributed
    state.wait_for_everyone()
    with state.main_process_first(), state.split_between_processes([1, 2]) as shard:
        assert shard == [1, 2]
    assert repr(state).endswith("Mixed precision type: no\n")
    assert AcceleratorState().mixed_precision == "no"  # later instances share the state


@pytest.mark.parametrize("variable", ["ACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION"])
def test_mixed_precision_from_env(monkeypatch, variable):
    monkeypatch.setenv(variable, "BF16")
    assert AcceleratorState(_from_accelerator=True).mixed_precision == "bf16"


def test_mixed_precision_argument_beats_env(monkeypatch):
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")
    assert AcceleratorState("fp16", _from_accelerator=True).mixed_precision == "fp16"


def test_bad_mixed_precision_lists_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="mixed_precision='fp12'.*'no', 'fp16', 'bf16', 'fp8'"):
        AcceleratorState("fp12", _from_accelerator=True)
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "half")
    with pytest.raises(ValueError, match="ACCEL_MIXED_PRECISION='half'"):
        AcceleratorState(_from_accelerator=True)
    assert not is_initialized() and PartialState._shared_state == {}


def test_mixed_precision_cannot_change_once_initialized():
    AcceleratorState("bf16", _from_accelerator=True)
    assert AcceleratorState("BF16").mixed_precision == "bf16"
    with pytest.raises(ValueError, match="already been initialized"):
        AcceleratorState("fp16")


def test_accelerator_state_reset():
    AcceleratorState(_from_accelerator=True)
    AcceleratorState._reset_state()
    assert not is_initialized() and PartialState._shared_state != {}
    AcceleratorState(_from_accelerator=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_MEGATRON_LM"])  # FSDP, DeepSpeed run: tests/fsdp, tests/deepspeed
def test_unsupported_plugins_are_refused(monkeypatch, variable):
    monkeypatch.setenv(variable, "true")
    expected = f"not supported by accel \\(asked for by the environment variable {variable}\\)"
    with pytest.raises(UnsupportedFeatureError, match=expected):
        AcceleratorState(_from_accelerator=True)


def test_dynamo_plugin_is_stored_as_given():
    plugin = object()
    assert AcceleratorState(dynamo_plugin=plugin, _from_accelerator=True).dynamo_plugin is plugin


# --- GradientState -------------------------------------------------------------------------------------------------


class _Plugin:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def to_kwargs(self):
        return dict(self.kwargs)


class _Loader:
    def __init__(self, end_of_dataloader=False, remainder=0):
        self.end_of_dataloader = end_of_dataloader
        self.remainder = remainder


def test_gradient_state_defaults():
    state = GradientState()
    assert state.initialized and state.sync_gradients
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (1, False, True)
    assert state.plugin_kwargs == {}
    assert state.active_dataloader is None and not state.in_dataloader
    assert state.dataloader_references == [None]
    assert not state.end_of_dataloader and state.remainder == -1
    assert "Sync Gradients: True" in repr(state)


def test_gradient_state_plugin_kwargs_update():
    state = GradientState(_Plugin(num_steps=4, adjust_scheduler=True))
    assert (state.num_steps, state.adjust_scheduler) == (4, True)
    assert GradientState().num_steps == 4  # no plugin: keeps the shared kwargs
    GradientState(_Plugin(num_steps=2, sync_with_dataloader=False))
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (2, False, False)


def test_gradient_state_dataloader_bookkeeping():
    state = GradientState()
    outer, inner = _Loader(), _Loader(end_of_dataloader=True, remainder=3)
    state._add_dataloader(outer)
    state._add_dataloader(inner)
    assert state.dataloader_references == [None, outer, inner]
    assert state.active_dataloader is inner and state.in_dataloader
    assert state.end_of_dataloader and state.remainder == 3
    state._remove_dataloader(inner)
    assert state.active_dataloader is outer and not state.end_of_dataloader and state.remainder == 0
    state._remove_dataloader(outer)
    assert not state.in_dataloader
    state._set_sync_gradients(False)
    assert not GradientState().sync_gradients


def test_gradient_state_holds_dataloaders_weakly():
    state = GradientState()
    loader = _Loader()
    alive = weakref.ref(loader)
    state._add_dataloader(loader)
    del loader
    assert alive() is None and state.dataloader_references == [None, None] and not state.in_dataloader


def test_gradient_state_reset():
    GradientState(_Plugin(num_steps=8))._set_sync_gradients(False)
    GradientState._reset_state()
    assert GradientState().sync_gradients and GradientState().num_steps == 1


# --- Several processes ---------------------------------------------------------------------------------------------


def _describe():
    state = PartialState()
    return {
        "type": state.distributed_type,
        "backend": state.backend,
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "local_process_index": state.local_process_index,
        "main": state.is_main_process,
        "local_main": state.is_local_main_process,
        "last": state.is_last_process,
        "use_distributed": state.use_distributed,
        "device": str(state.device),
        "group": dist.is_initialized() and dist.get_world_size(),
    }


@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if w > 1])
def test_launched_cpu_processes_are_multi_cpu_without_cpu_flag(world_size):
    for rank, info in enumerate(run_on_ranks(_describe, world_size)):
        assert info == {
            "type": DistributedType.MULTI_CPU,
            "backend": "gloo",
            "num_processes": world_size,
            "process_index": rank,
            "local_process_index": rank,
            "main": rank == 0,
            "local_main": rank == 0,
            "last": rank == world_size - 1,
            "use_distributed": world_size > 1,
            "device": "cpu",
            "group": world_size,
        }


def test_one_launched_cpu_process_is_not_distributed():
    # As HF Accelerate: MULTI_CPU needs several processes; one is NO, with no process group.
    (info,) = run_on_ranks(_describe, 1)
    assert info["type"] == DistributedType.NO and info["group"] is False and info["backend"] is None


def _barrier_times(delay: float):
    state = PartialState()
    if state.is_main_process:
        time.sleep(delay)
    arrived = time.monotonic()
    state.wait_for_everyone()
    return arrived, time.monotonic()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_wait_for_everyone(world_size):
    times = run_on_ranks(_barrier_times, world_size, 0.3)
    last_arrival = max(arrived for arrived, _ in times)
    assert all(left >= last_arrival for _, left in times)


def _goes_first_times(context: str, delay: float):
    state = PartialState()
    with getattr(state, context)():
        entered = time.monotonic()
        time.sleep(delay if state.is_main_process else 0.0)
        left = time.monotonic()
    return entered, left


@pytest.mark.parametrize("context", ["main_process_first", "local_main_process_first"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_main_process_goes_first(world_size, context):
    times = run_on_ranks(_goes_first_times, world_size, context, 0.3)
    main_left = times[0][1]
    assert all(entered >= main_left for entered, _ in times[1:])


def _split_on_rank(state_class: str):
    state = PartialState() if state_class == "PartialState" else AcceleratorState(_from_accelerator=True)
    results = {}
    for length in range(10):
        for padding in (False, True):
            for case, inputs in _split_cases(length).items():
                with state.split_between_processes(inputs, apply_padding=padding) as shard:
                    results[(length, padding, case)] = shard
    return results


@pytest.mark.parametrize("state_class", ["PartialState", "AcceleratorState"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_split_between_processes_on_ranks(world_size, state_class):
    for rank, results in enumerate(run_on_ranks(_split_on_rank, world_size, state_class)):
        for (length, padding, case), shard in results.items():
            indices = _hf_indices(length, world_size, rank, padding)
            _assert_same(shard, _expected_split(case, length, indices))


def _printed():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        PartialState().print("hello from", os.environ["RANK"])
    return out.getvalue()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_print_only_on_local_main(world_size):
    assert run_on_ranks(_printed, world_size) == ["hello from 0\n"] + [""] * (world_size - 1)


def _decorated():
    state = PartialState()
    ran = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_local_main_process(lambda: ran.append("local_main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=1)(lambda: ran.append("process 1"))()
    state.on_process(lambda: ran.append("process 0 (positional)"), process_index=0)()
    state.on_local_process(local_process_index=1)(lambda: ran.append("local 1"))()
    return ran


def test_decorators_on_ranks():
    assert run_on_ranks(_decorated, 4) == [
        ["main", "local_main", "process 0 (positional)"],
        ["process 1", "local 1"],
        [],
        ["last"],
    ]


def test_decorators_on_one_launched_rank_run_everything():
    assert run_on_ranks(_decorated, 1) == [
        ["main", "local_main", "last", "process 1", "process 0 (positional)", "local 1"],
    ]


def _destroy():
    state = PartialState()
    before = dist.is_initialized()
    state.destroy_process_group()
    return before, dist.is_initialized()


@pytest.mark.parametrize("world_size", [1, 2])
def test_destroy_process_group(world_size):
    had_group = world_size > 1  # one CPU process has no group to destroy, and destroying is then a no-op
    assert run_on_ranks(_destroy, world_size) == [(had_group, False)] * world_size


def _timeouts(kwarg_seconds):
    kwargs = {} if kwarg_seconds is None else {"timeout": timedelta(seconds=kwarg_seconds)}
    state = PartialState(**kwargs)
    group = dist.distributed_c10d._get_default_group()
    return state.timeout, group._get_backend(torch.device("cpu")).options._timeout


def test_timeout_from_kwarg_reaches_the_process_group(monkeypatch):
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "17")
    assert run_on_ranks(_timeouts, 2, 42) == [(timedelta(seconds=42),) * 2] * 2


def test_timeout_from_env_reaches_the_process_group(monkeypatch):
    monkeypatch.setenv("ACCEL_PROCESS_GROUP_TIMEOUT", "17")
    assert run_on_ranks(_timeouts, 2, None) == [(timedelta(seconds=17),) * 2] * 2


def test_default_timeout_is_torchs():
    assert run_on_ranks(_timeouts, 2, None) == [(dist.default_pg_timeout,) * 2] * 2


def _adopt_user_group():
    dist.init_process_group("gloo", timeout=timedelta(seconds=33))
    state = PartialState()
    return state.distributed_type, state.backend, state.num_processes, state.process_index, state.timeout


def test_an_existing_process_group_is_adopted():
    assert run_on_ranks(_adopt_user_group, 2) == [
        (DistributedType.MULTI_CPU, "gloo", 2, rank, timedelta(seconds=33)) for rank in range(2)
    ]


def _missing_rank_barrier(timeout_s: float):
    state = PartialState(timeout=timedelta(seconds=timeout_s))
    if not state.is_main_process:
        time.sleep(timeout_s + 1)  # stays alive but never arrives
        return None
    started = time.monotonic()
    try:
        state.wait_for_everyone()
    except RuntimeError as error:
        return time.monotonic() - started, str(error)
    return None


@pytest.mark.timeout(60)
def test_barrier_honours_the_timeout():
    # 3 s, not less: the same timeout bounds the rendezvous, which a loaded 2-core machine can slow down.
    elapsed, message = run_on_ranks(_missing_rank_barrier, 2, 3.0, timeout=60)[0]
    assert 2.9 <= elapsed < 20  # bounded by the timeout, not by the 30-minute default
    assert "3000" in message or "timed out" in message.lower() or "timeout" in message.lower()


@pytest.mark.timeout(60)
def test_debug_mode_barrier_names_the_missing_rank(monkeypatch):
    monkeypatch.setenv("ACCEL_DEBUG_MODE", "1")
    elapsed, message = run_on_ranks(_missing_rank_barrier, 2, 3.0, timeout=60)[0]
    assert elapsed < 20
    assert "Ranks 1 failed to pass monitoredBarrier" in message


def _bad_backend():
    try:
        PartialState(backend="nccl")
    except ValueError as error:
        return str(error), PartialState._shared_state == {}, dist.is_initialized()
    return None


@pytest.mark.skipif(dist.is_backend_available("nccl"), reason="this torch build has NCCL")
def test_unavailable_backend_is_refused():
    message, uninitialized, group = run_on_ranks(_bad_backend, 2)[0]
    assert "'nccl' is not available" in message and "'gloo'" in message
    assert uninitialized and not group


def _accelerator_state_on_rank():
    state = AcceleratorState(_from_accelerator=True)
    with state.main_process_first():
        pass
    state.wait_for_everyone()
    return (
        state.mixed_precision,
        state.distributed_type,
        state.process_index,
        state.num_processes,
        state.is_main_process,
        state.is_last_process,
        state.use_distributed,
    )


def test_accelerator_state_on_ranks(monkeypatch):
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")
    assert run_on_ranks(_accelerator_state_on_rank, 2) == [
        ("fp16", DistributedType.MULTI_CPU, 0, 2, True, False, True),
        ("fp16", DistributedType.MULTI_CPU, 1, 2, False, True, True),
    ]


def test_padding_length_is_the_ceiling():
    for world_size in range(2, 5):
        for length in range(1, 10):
            shard = state_module._split_inputs(list(range(length)), world_size, world_size - 1, apply_padding=True)
            assert len(shard) == math.ceil(length / world_size)


# --- GPU host (skipped without CUDA) ---------------------------------------------------------------------------------

_TORCHRUN_RANK = """
import json, torch
from accel.state import PartialState
state = PartialState()
state.wait_for_everyone()
print(json.dumps({"type": state.distributed_type.value, "backend": state.backend, "device": str(state.device),
                  "current": torch.cuda.current_device() if torch.cuda.is_available() else None}))
state.destroy_process_group()
"""


def _torchrun_one_rank(tmp_path) -> dict:
    script = tmp_path / "rank.py"
    script.write_text(_TORCHRUN_RANK)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_torchrun_on_a_gpu_host_is_multi_gpu_with_nccl(tmp_path):
    assert _torchrun_one_rank(tmp_path) == {"type": "MULTI_GPU", "backend": "nccl", "device": "cuda:0", "current": 0}
