"""HF's `accelerate.utils.other` names in accel: regional compilation, unwrapping prepared models, save/load on the
main process, and the small helpers (names, sizes, dict merging, module walks)."""

import io
import logging
import os
import pickle
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from spawn_pool import run_on_ranks

from accel.utils import (
    clean_state_dict_for_safetensors,
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    convert_bytes,
    convert_outputs_to_fp32,
    extract_model_from_parallel,
    get_model_tp_size,
    get_module_children_bottom_up,
    get_pretty_name,
    has_compiled_regions,
    is_compiled_module,
    load,
    merge_dicts,
    model_has_dtensor,
    recursive_getattr,
    save,
    tqdm,
    wait_for_everyone,
)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class Stack(torch.nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def _fresh_compiler():
    yield
    if "torch._dynamo" in __import__("sys").modules:
        torch._dynamo.reset()


# --- compilation -------------------------------------------------------------------------------------------------


def test_compile_regions_compiles_each_block_and_keeps_the_original():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(5, 4)
    compiled = compile_regions(model, backend="eager")
    assert type(compiled) is Stack and compiled is not model and compiled._orig_mod is model
    assert all(is_compiled_module(block) for block in compiled.blocks)
    assert is_compiled_module(compiled.head)  # the rest, compiled as a whole
    assert not any(is_compiled_module(block) for block in model.blocks)  # the original is untouched
    assert has_compiled_regions(compiled) and not is_compiled_module(compiled) and not has_compiled_regions(model)
    assert compiled.blocks[0]._orig_mod.linear.weight is model.blocks[0].linear.weight  # parameters shared
    torch.testing.assert_close(compiled(x), model(x))
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    assert extract_model_from_parallel(compiled) is compiled


def test_compile_regions_without_repeated_blocks_compiles_the_whole_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiled = compile_regions(model, backend="eager")
    assert is_compiled_module(compiled) and compiled._orig_mod is model
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model


def test_compile_regions_keeps_a_patched_forward_working():
    from accel.precision import BF16Precision

    model, x = BF16Precision(torch.device("cpu")).wrap_forward(Stack()), torch.randn(2, 4)
    compiled = compile_regions(model, backend="eager")
    output = compiled(x)
    assert output.dtype == torch.float32  # the autocast forward ran on the compiled copy, outputs upcast
    torch.testing.assert_close(output, model(x))


@pytest.mark.parametrize("compile_in_place", [compile_regions_fsdp2, compile_regions_deepspeed])
def test_compile_regions_in_place(compile_in_place):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 4)
    expected = model(x)
    returned = compile_in_place(model, backend="eager")
    assert returned is (model if compile_in_place is compile_regions_fsdp2 else None)
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model.head._compiled_call_impl is not None
    torch.testing.assert_close(model(x), expected)


# --- unwrapping --------------------------------------------------------------------------------------------------


def test_unwrap_data_parallel_and_compile():
    model = Stack()
    wrapped = torch.compile(torch.nn.DataParallel(model), backend="eager")
    assert extract_model_from_parallel(wrapped, keep_torch_compile=False) is model
    kept = extract_model_from_parallel(wrapped)
    assert kept is wrapped and kept._orig_mod is model  # HF's: the compiled wrapper now holds the bare model


def test_unwrap_a_model_compiled_inside_its_wrapper():
    from accel.precision import BF16Precision

    model = BF16Precision(torch.device("cpu")).wrap_forward(torch.nn.Linear(4, 4))
    compiled = torch.compile(model, backend="eager")
    wrapped = torch.nn.DataParallel(compiled)  # as accel's DDP(torch.compile(model)) for fullgraph compilation
    assert extract_model_from_parallel(wrapped) is compiled and compiled._orig_mod is model
    assert extract_model_from_parallel(wrapped, keep_torch_compile=False, keep_fp32_wrapper=False) is model
    assert model.forward.__func__ is torch.nn.Linear.forward  # the autocast forward removed under the compile


def test_unwrap_recursively():
    model = Stack()
    model.head = torch.nn.DataParallel(model.head)
    inner = model.head.module
    assert extract_model_from_parallel(model, recursive=True).head is inner


def test_unwrap_removes_hf_style_fp32_forward():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    model._original_forward = model.forward
    model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    assert model(torch.ones(1, 4, dtype=torch.bfloat16)).dtype == torch.float32
    unwrapped = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert unwrapped(torch.ones(1, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert "_original_forward" not in unwrapped.__dict__


def _unwrap_prepared(mixed_precision):
    from accel import Accelerator

    model = torch.nn.Linear(3, 3)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    prepared = accelerator.prepare(model)
    kept = extract_model_from_parallel(prepared)
    kept_wrapper = kept.forward.__func__ is not torch.nn.Linear.forward
    same_as_accelerator = kept is accelerator.unwrap_model(prepared)
    plain = extract_model_from_parallel(prepared, keep_fp32_wrapper=False)
    return (
        type(prepared).__name__,
        kept is model,
        kept_wrapper,
        same_as_accelerator,
        plain is model,
        plain.forward.__func__ is not torch.nn.Linear.forward,
    )


def test_unwrap_a_model_prepared_on_two_processes():
    expected = ("DistributedDataParallel", True, True, True, True, False)
    assert run_on_ranks(_unwrap_prepared, 2, "bf16") == [expected] * 2


# --- save and load -----------------------------------------------------------------------------------------------


def test_save_and_load_a_pickle(tmp_path):
    state = {"step": 3, "weights": torch.arange(4.0), "rng": np.random.RandomState(0).get_state()[1]}
    save(state, tmp_path / "state.bin")
    before = set(map(str, torch.serialization.get_safe_globals()))
    loaded = load(tmp_path / "state.bin")
    assert set(map(str, torch.serialization.get_safe_globals())) == before  # the numpy allowance is scoped to the call
    assert loaded["step"] == 3 and torch.equal(loaded["weights"], state["weights"])
    assert np.array_equal(loaded["rng"], state["rng"])
    assert [name for name in os.listdir(tmp_path)] == ["state.bin"]  # no temporary file left


def test_load_refuses_arbitrary_objects_unless_asked(tmp_path):
    torch.save({"namespace": SimpleNamespace(a=1)}, tmp_path / "any.bin")
    with pytest.raises(pickle.UnpicklingError):
        load(tmp_path / "any.bin")
    assert load(tmp_path / "any.bin", weights_only=False)["namespace"].a == 1


def test_save_safetensors_drops_aliases(tmp_path, caplog):
    model = torch.nn.Linear(4, 4, bias=False)
    state = {"a.weight": model.weight, "b.weight": model.weight, "t": torch.ones(2, 3).t()}
    with caplog.at_level(logging.WARNING):
        save(state, tmp_path / "model.safetensors", safe_serialization=True)
    assert "b.weight" in caplog.text
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["a.weight", "t"] and f.metadata() == {"format": "pt"}
        torch.testing.assert_close(f.get_tensor("t"), torch.ones(3, 2))
    assert sorted(state) == ["a.weight", "b.weight", "t"]  # the caller's dict is left as it was


def test_save_to_file_objects():
    buffer = io.BytesIO()
    save({"x": torch.ones(2)}, buffer, safe_serialization=True)
    from safetensors.torch import load as from_bytes

    assert torch.equal(from_bytes(buffer.getvalue())["x"], torch.ones(2))
    buffer = io.BytesIO()
    save({"x": torch.ones(2)}, buffer)
    buffer.seek(0)
    assert torch.equal(load(buffer)["x"], torch.ones(2))
    with pytest.raises(TypeError, match="not tensors"):
        save({"x": "text"}, io.BytesIO(), safe_serialization=True)


def test_clean_state_dict_for_safetensors():
    weight = torch.ones(2, 2)
    state = {"w": weight, "tied": weight, "view": weight.t(), "quant": "nf4"}
    cleaned = clean_state_dict_for_safetensors(state)
    assert list(cleaned) == ["w", "view", "quant"] and "tied" not in state  # HF: the dict given loses them too
    assert cleaned["view"].is_contiguous() and cleaned["quant"] == "nf4"


def _save_from_every_rank(path, save_on_each_node):
    from accel.state import PartialState

    rank = PartialState().process_index
    save({"rank": torch.tensor(rank)}, path, save_on_each_node=save_on_each_node)
    wait_for_everyone()
    return int(load(path)["rank"])


@pytest.mark.parametrize("save_on_each_node", [False, True])
def test_only_the_main_process_writes(tmp_path, save_on_each_node):
    path = str(tmp_path / "state.bin")
    assert run_on_ranks(_save_from_every_rank, 2, path, save_on_each_node) == [0, 0]


def _ordered_by_barrier(path):
    from accel.state import PartialState

    if PartialState().process_index == 1:
        with open(path, "w") as f:
            f.write("written before the barrier")
    wait_for_everyone()
    return os.path.exists(path)


def test_wait_for_everyone(tmp_path):
    assert run_on_ranks(_ordered_by_barrier, 2, str(tmp_path / "flag")) == [True, True]


def _bar_disabled(main_process_only):
    import threading

    import tqdm as tqdm_package

    from accel.state import PartialState

    # tqdm's default lock is a multiprocessing semaphore, which would outlive the test in the reused workers.
    tqdm_package.tqdm.set_lock(threading.RLock())
    PartialState()
    return tqdm(range(3), main_process_only=main_process_only, file=io.StringIO()).disable


def test_tqdm_shows_on_the_main_process_only():
    assert run_on_ranks(_bar_disabled, 2, True) == [False, True]
    assert run_on_ranks(_bar_disabled, 2, False) == [False, False]
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


# --- small helpers -----------------------------------------------------------------------------------------------


def test_names_and_sizes():
    assert get_pretty_name(torch.optim.AdamW) == "AdamW"
    assert get_pretty_name(torch.nn.Linear(1, 1)) == "Linear"
    assert get_pretty_name(Stack.forward) == "Stack.forward"
    assert [convert_bytes(size) for size in (512, 1536, 3 * 2**30, 2**50 * 5)] == [
        "512 bytes",
        "1.5 KB",
        "3.0 GB",
        "5.0 PB",
    ]


def test_merge_dicts():
    destination = {"a": {"y": 2}, "b": 3}
    assert merge_dicts({"a": {"x": 1}, "b": 4, "c": {"d": 5}}, destination) is destination
    assert destination == {"a": {"y": 2, "x": 1}, "b": 4, "c": {"d": 5}}


def test_module_walks():
    model = Stack(depth=2)
    assert recursive_getattr(model, "blocks.1.linear.weight") is model.blocks[1].linear.weight
    names = [name for name, _ in get_module_children_bottom_up(model, return_fqns=True)]
    assert names == ["blocks.0.linear", "blocks.0", "blocks.1.linear", "blocks.1", "blocks", "head", ""]
    modules = get_module_children_bottom_up(model)
    assert modules[-1] is model and modules[0] is model.blocks[0].linear


def test_model_parallel_facts():
    model = torch.nn.Linear(2, 2)
    assert model_has_dtensor(model) is False
    assert get_model_tp_size(model) is None
    model.tp_size = 4
    assert get_model_tp_size(model) == 4
    model.tp_size = None
    model.config = SimpleNamespace(distributed_config={"tp_size": 2})
    assert get_model_tp_size(model) == 2
    model.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=8))
    assert get_model_tp_size(model) == 8
