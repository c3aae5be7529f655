"""Names HF Accelerate's modules define besides their main classes, with HF's behaviour: accel.state's shared-state
helpers, accel.optimizer's helpers, accel.launchers' self-test and constant, accel.utils.dataclasses' aliases and
Megatron-LM config parsers. (tests/conformance checks that every such name resolves.)"""

import threading
import warnings
from collections import namedtuple
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

import accel.launchers
import accel.utils.constants
from accel.optimizer import move_to_device, patch_optimizer_step
from accel.state import PartialState, SharedDict, ThreadLocalSharedDict, do_nothing
from accel.utils import dataclasses as hf_dataclasses


def test_do_nothing_takes_anything():
    assert do_nothing() is None and do_nothing(1, key="value") is None


def test_thread_local_shared_dict_is_one_dict_per_thread_shared_by_instances():
    class Borg:
        _shared_state = ThreadLocalSharedDict()

    first, second = Borg(), Borg()
    first._shared_state["a"] = 1
    assert second._shared_state == Borg._shared_state == {"a": 1}
    seen = []
    thread = threading.Thread(target=lambda: seen.append(dict(Borg()._shared_state)))
    thread.start()
    thread.join()
    assert seen == [{}]  # another thread has its own dict
    first._shared_state = {"b": 2}  # assigning through an instance replaces the dict
    assert second._shared_state == {"b": 2}


def test_the_singletons_share_a_shared_dict():
    assert SharedDict is dict and type(PartialState._shared_state) is SharedDict


def test_move_to_device_moves_every_tensor_of_a_state_dict():
    Pair = namedtuple("Pair", "a b")
    state = {"state": {0: {"exp_avg": torch.ones(2), "step": 3}}, "groups": [Pair(torch.zeros(1), "x")]}
    moved = move_to_device(state, "meta")
    assert moved["state"][0]["exp_avg"].device.type == "meta" and moved["state"][0]["step"] == 3
    assert isinstance(moved["groups"][0], Pair) and moved["groups"][0].a.is_meta and moved["groups"][0].b == "x"
    assert state["state"][0]["exp_avg"].device.type == "cpu"  # a copy; the original is left alone


def test_patch_optimizer_step_marks_the_call_and_returns_the_step_s_result():
    holder = SimpleNamespace(_accelerate_step_called=False)
    patched = patch_optimizer_step(holder, lambda *args, **kwargs: (args, kwargs))
    assert patched(1, closure=None) == ((1,), {"closure": None}) and holder._accelerate_step_called


def test_test_launch_creates_the_partial_state():
    accel.launchers.test_launch()
    assert PartialState().initialized


def test_elastic_log_line_prefix_version_is_hf_s_and_one_object():
    version = accel.launchers.ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION
    assert version == "2.2.0" and accel.utils.constants.ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION is version


def test_literal_aliases_are_the_values_the_fields_take():
    assert get_args(hf_dataclasses.FP8Format) == ("HYBRID", "E4M3", "E5M2")
    assert get_args(hf_dataclasses.AmaxComputeAlgorithm) == ("max", "most_recent")
    assert get_args(hf_dataclasses.OptLevel) == ("O1", "O2") and get_args(hf_dataclasses.Backend) == ("MSAMP", "TE")
    assert set(get_args(hf_dataclasses.ProfilerActivity)) == {"cpu", "xpu", "mtia", "cuda", "hpu"}
    with pytest.raises(ValueError, match="fp8_format"):
        hf_dataclasses.TERecipeKwargs(fp8_format="E3M4")


def _model(class_name, **config):
    model = type(class_name, (), {})()
    model.config = SimpleNamespace(return_dict=True, **config)
    return model


def _network_args(model, batch=None, **fields):
    plugin = hf_dataclasses.MegatronLMPlugin(**fields)
    before = dict(plugin.megatron_lm_default_args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.set_network_size_args(model, batch)
    args = plugin.megatron_lm_default_args
    return {key: value for key, value in args.items() if before.get(key, "unset") != value}, caught


BERT = dict(
    model_type="megatron-bert",
    num_hidden_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    max_position_embeddings=64,
    num_labels=3,
    vocab_size=50,
)


def test_megatron_parsers_fill_the_network_size_arguments_as_hf_s():
    args, _ = _network_args(_model("MegatronBertForMaskedLM", **BERT))
    assert args == {
        "seq_length": 64,
        "model_type_name": "bert",
        "num_layers": 2,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
        "pretraining_flag": True,
        "orig_vocab_size": 50,
        "model_return_dict": True,
        "num_labels": 3,
    }
    gpt2 = _model("GPT2LMHeadModel", model_type="gpt2", n_layer=2, n_embd=8, n_head=2, n_positions=64, vocab_size=50)
    args, _ = _network_args(gpt2, {"input_ids": torch.zeros(2, 16)})
    assert args["seq_length"] == 16 and args["tokenizer_type"] == "GPT2BPETokenizer" and args["num_layers"] == 2
    t5 = _model("T5Model", model_type="t5", num_layers=2, d_model=8, num_heads=2, vocab_size=50)
    args, _ = _network_args(t5, {"input_ids": torch.zeros(2, 16), "labels": torch.zeros(2, 7)})
    assert (args["encoder_seq_length"], args["decoder_seq_length"], args["max_position_embeddings"]) == (16, 7, 1024)
    llama = _model(
        "LlamaForCausalLM",
        model_type="llama",
        num_hidden_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        max_position_embeddings=64,
        vocab_size=50,
        max_sequence_length=48,
    )
    args, _ = _network_args(llama)
    assert args["seq_length"] == 48 and args["tokenizer_type"] == "Llama2Tokenizer" and args["model_type_name"] == "gpt"


def test_a_given_seq_length_is_kept_unless_the_stack_s_own_length_is_set():
    """HF replaces a given seq_length with encoder_seq_length even when that is None; accel keeps it."""
    args, caught = _network_args(_model("MegatronBertModel", **BERT), seq_length=32)
    assert args["seq_length"] == 32 and not args["pretraining_flag"] and caught == []
    args, caught = _network_args(_model("MegatronBertModel", **BERT), seq_length=32, encoder_seq_length=16)
    assert args["seq_length"] == 16 and "encoder_seq_length" in str(caught[0].message)
