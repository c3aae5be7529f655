"""FSDP2 through `Accelerator` on 2 CPU processes (issue 21): parity with DDP, sharded parameters, the fused clip
over shards, fp16 loss scaling with sharded gradients, sharded save_state / load_state (bit-identical resume, a
different number of processes), the full state dict for save_model, and what is refused."""

import os
import warnings

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.accelerator import Accelerator
from accel.backends.fsdp import FullyShardedDataParallelPlugin
from accel.state import AcceleratorState, GradientState
from accel.unsupported import UnsupportedFeatureError

transformers = pytest.importorskip("transformers")


def fresh_accelerator(fsdp=True, **kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(**{"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap",
                                               **(fsdp if isinstance(fsdp, dict) else {})})  # fmt: skip
    return Accelerator(fsdp_plugin=plugin if fsdp else None, **kwargs)


def grad_kernels_loaded():
    from accel.precision import grads

    return grads.native_on("cpu")


def tiny_gpt2(seed=0):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def batches(process_index, steps, seed=0):
    generator = torch.Generator().manual_seed(1000 * seed + process_index)
    return [torch.randint(0, 97, (2, 16), generator=generator) for _ in range(steps)]


def train(accelerator, model, optimizer, data, max_norm=1.0):
    losses, norms = [], []
    for tokens in data:
        with accelerator.accumulate(model):
            loss = model(tokens, labels=tokens).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def prepared(accelerator, seed=0):
    model = tiny_gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return accelerator.prepare(model, optimizer)


def full_weights(accelerator, model):
    return {name: t.clone() for name, t in accelerator.get_state_dict(model).items()}


# --- training ----------------------------------------------------------------------------------------------------


def _fsdp_and_ddp(steps):
    from accel.precision import grads

    results = {}
    fused_clips = []
    real = grads.ops.clip_grads_
    grads.ops.clip_grads_ = lambda local, *args: (fused_clips.append(len(local)), real(local, *args))
    try:
        for setup in ("ddp", "fsdp"):
            fused_clips.clear()
            accelerator = fresh_accelerator(setup == "fsdp", gradient_accumulation_steps=2)
            model, optimizer = prepared(accelerator)
            losses, norms = train(accelerator, model, optimizer, batches(accelerator.process_index, steps))
            results[setup] = (str(accelerator.distributed_type), losses, norms, full_weights(accelerator, model))
    finally:
        grads.ops.clip_grads_ = real
    results["fused_clips"] = len(fused_clips)
    from torch.distributed.fsdp import FSDPModule

    block = transformers.models.gpt2.modeling_gpt2.GPT2Block
    units = [m for m in model.modules() if isinstance(m, block)]
    local = {name: p.to_local().numel() for name, p in model.named_parameters()}
    whole = {name: p.numel() for name, p in model.named_parameters()}
    results["shards"] = (sum(local.values()), sum(whole.values()), all(isinstance(m, FSDPModule) for m in units),
                         model.lm_head.weight is model.transformer.wte.weight)  # fmt: skip
    return results


def test_fsdp2_trains_as_ddp_does_with_its_state_sharded():
    """Same losses as DDP to fp32 rounding over 20 steps (accumulating 2), the clip's norm too; each process holds
    about half the parameters; GPT2Block is its own unit; tied embeddings stay tied."""
    for rank, result in enumerate(run_on_ranks(_fsdp_and_ddp, 2, 20, timeout=240)):
        ddp_type, ddp_losses, ddp_norms, ddp_weights = result["ddp"]
        fsdp_type, fsdp_losses, fsdp_norms, fsdp_weights = result["fsdp"]
        assert (ddp_type, fsdp_type) == ("DistributedType.MULTI_CPU", "DistributedType.FSDP")
        torch.testing.assert_close(fsdp_losses, ddp_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fsdp_norms, ddp_norms, rtol=1e-5, atol=1e-6)
        # The fused clip ran on the local shards (native kernels), or torch's over DTensors (without them).
        assert result["fused_clips"] == (10 if grad_kernels_loaded() else 0)
        local, whole, blocks_are_units, tied = result["shards"]
        assert local <= whole // 2 + 1024 and blocks_are_units and tied
        if rank == 0:  # the full state dict is gathered onto the main process
            assert fsdp_weights.keys() == ddp_weights.keys()
            for name in ddp_weights:
                torch.testing.assert_close(fsdp_weights[name], ddp_weights[name], rtol=1e-4, atol=1e-5)
        else:
            assert fsdp_weights == {}


def _fp16_overflow_skips_on_every_process():
    accelerator = fresh_accelerator(mixed_precision="fp16")
    model, optimizer = prepared(accelerator)
    before = full_weights(accelerator, model)
    tokens = batches(accelerator.process_index, 1)[0]
    accelerator.backward(model(tokens, labels=tokens).loss)
    if accelerator.process_index == 1:  # an overflow in one process's shard only
        next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    skipped = accelerator.optimizer_step_was_skipped
    unchanged = all(torch.equal(a, b) for a, b in zip(before.values(), full_weights(accelerator, model).values()))
    optimizer.zero_grad()
    losses, _ = train(accelerator, model, optimizer, batches(accelerator.process_index, 4, seed=1))
    masters = {p.dtype for p in model.parameters()}
    return skipped, unchanged, losses, masters


def test_fp16_loss_scaling_skips_a_step_whose_overflow_only_one_shard_holds():
    results = run_on_ranks(_fp16_overflow_skips_on_every_process, 2, timeout=180)
    for skipped, unchanged, losses, masters in results:
        assert skipped and masters == {torch.float32}
        assert all(torch.isfinite(torch.tensor(losses)))
    assert results[0][1]  # the main process sees the full weights: untouched by the skipped step


# The elementwise optimizers' settings the test steps with, and the state each keeps per parameter.
SHARD_STEP_OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3}, ("exp_avg", "exp_avg_sq")),
    "Adam amsgrad": (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "SGD momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, ("momentum_buffer",)),  # state made by the step
}


def _optimizer_steps_on_local_shards(name):
    from torch.distributed.tensor import DTensor

    factory, settings, state_names = SHARD_STEP_OPTIMIZERS[name]
    accelerator = fresh_accelerator()
    model = tiny_gpt2()
    model, optimizer = accelerator.prepare(model, factory(model.parameters(), **settings))
    stepped_types = []
    optimizer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: stepped_types.append(
        sorted({type(p).__name__ for group in opt.param_groups for p in group["params"]})))  # fmt: skip
    reference, reference_optimizer = None, None
    same = []
    for tokens in batches(accelerator.process_index, 2):
        accelerator.backward(model(tokens, labels=tokens).loss)
        if reference is None:  # torch's optimizer on whole tensors, from the same weights and gradients
            reference = [torch.nn.Parameter(p.full_tensor().clone()) for p in model.parameters()]
            reference_optimizer = factory(reference, foreach=True, **settings)
        for whole, param in zip(reference, model.parameters()):
            whole.grad = param.grad.full_tensor()
        reference_optimizer.step()
        optimizer.step()
        same.append(all(torch.equal(whole, param.full_tensor()) for whole, param in zip(reference, model.parameters())))
        optimizer.zero_grad()
    state = list(optimizer.optimizer.state.items())
    layouts = all(isinstance(values[key], DTensor) and values[key].placements == param.placements
                  and values[key].shape == param.shape for param, values in state for key in state_names)  # fmt: skip
    keys = all(any(key is param for param in model.parameters()) for key, _ in state)
    shard_grads = [p.to_local().grad for p in model.parameters() if p.to_local().grad is not None]
    return stepped_types, same, layouts and keys and len(state) == len(reference), len(shard_grads)


@pytest.mark.parametrize("name", list(SHARD_STEP_OPTIMIZERS))
def test_elementwise_optimizers_step_on_the_local_shards_as_on_whole_tensors(name):
    """torch's elementwise optimizers step each process's shards as plain tensors (DTensor's dispatch costs more
    than the update on CPU processes), with the same result as torch's on the whole tensors, bit for bit; between
    steps the optimizer holds the DTensors and DTensor state (also state the step made), and no shard keeps a
    gradient."""
    results = run_on_ranks(_optimizer_steps_on_local_shards, 2, name, timeout=180)
    for stepped_types, same, layouts, shard_grads in results:
        assert stepped_types == [["Tensor"], ["Tensor"]]
        assert same == [True, True]
        assert layouts and shard_grads == 0


# --- checkpoints -------------------------------------------------------------------------------------------------


def _save_train_load_train(folder):
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, batches(accelerator.process_index, 3))
    accelerator.save_state(folder)
    straight = train(accelerator, model, optimizer, batches(accelerator.process_index, 3, seed=2))
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator, seed=7)
    accelerator.load_state(folder)
    step = int(next(iter(optimizer.optimizer.state.values()))["step"])
    resumed = train(accelerator, model, optimizer, batches(accelerator.process_index, 3, seed=2))
    return straight, resumed, step, sorted(os.listdir(folder)), full_weights(accelerator, model)


def _full_state_resume(folder):
    accelerator = fresh_accelerator({"state_dict_type": "FULL_STATE_DICT"})
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, batches(accelerator.process_index, 3))
    accelerator.save_state(folder)
    straight = train(accelerator, model, optimizer, batches(accelerator.process_index, 3, seed=2))
    accelerator = fresh_accelerator({"state_dict_type": "FULL_STATE_DICT"})
    model, optimizer = prepared(accelerator, seed=7)
    accelerator.load_state(folder)
    resumed = train(accelerator, model, optimizer, batches(accelerator.process_index, 3, seed=2))
    return straight, resumed, sorted(os.listdir(folder))


def test_a_full_state_checkpoint_has_hf_files_and_resumes_bit_identically(tmp_path):
    for straight, resumed, listing in run_on_ranks(_full_state_resume, 2, str(tmp_path / "state"), timeout=240):
        assert straight == resumed
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(listing) and "pytorch_model_fsdp_0" not in listing


def _load_on_one_process(folder):
    accelerator = Accelerator()
    model, optimizer = prepared(accelerator, seed=9)
    accelerator.load_state(folder)
    return {name: t.clone() for name, t in model.state_dict().items()}


def test_a_sharded_checkpoint_resumes_bit_identically_and_loads_on_one_process(tmp_path):
    folder = str(tmp_path / "state")
    results = run_on_ranks(_save_train_load_train, 2, folder, timeout=240)
    for straight, resumed, step, listing, _ in results:
        assert straight == resumed and step == 3
        assert {"pytorch_model_fsdp_0", "optimizer_0", "random_states_0.pkl", "random_states_1.pkl"} <= set(listing)
        assert "model.safetensors" not in listing
    # One process without FSDP reads the same checkpoint: DCP reshards into plain tensors. Its weights are those of
    # the run that saved it, three steps before the end (the resumed run's last state is three steps later).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is ... uninitialized, ... a single process"
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        loaded = _load_on_one_process(folder)
    AcceleratorState._reset_state(reset_partial_state=True)
    reference = run_on_ranks(_weights_after_three_steps, 2, timeout=180)[0]
    for name, tensor in reference.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    # `accel merge-weights` turns the model's shards into one file transformers loads.
    from accel.checkpoint.dcp_merge import merge_fsdp_weights

    merge_fsdp_weights(os.path.join(folder, "pytorch_model_fsdp_0"), str(tmp_path / "merged"))
    tiny_gpt2().config.save_pretrained(tmp_path / "merged")
    merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged").state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=0)


def _weights_after_three_steps():
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, batches(accelerator.process_index, 3))
    return full_weights(accelerator, model)


def _save_model(folder):
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, batches(accelerator.process_index, 2))
    accelerator.save_model(model, folder)
    accelerator.wait_for_checkpoint()
    return full_weights(accelerator, model)


def test_save_model_writes_the_full_model_that_transformers_loads(tmp_path):
    expected = run_on_ranks(_save_model, 2, str(tmp_path / "model"), timeout=180)[0]
    tiny_gpt2().config.save_pretrained(tmp_path / "model")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


# --- configuration -----------------------------------------------------------------------------------------------


def _refusals_and_translation():
    outcome = {}
    with warnings.catch_warnings(record=True):
        accelerator = fresh_accelerator({"fsdp_version": 1, "sharding_strategy": "SHARD_GRAD_OP",
                                         "auto_wrap_policy": "transformer_based_wrap"})  # fmt: skip
    outcome["translated"] = (accelerator.strategy.plugin.fsdp_version, accelerator.strategy.plugin.reshard_after_forward)
    try:
        fresh_accelerator({"cpu_ram_efficient_loading": True})
    except UnsupportedFeatureError as error:
        outcome["ram"] = str(error)
    try:
        fresh_accelerator({"fsdp_version": 1, "sharding_strategy": "HYBRID_SHARD"})
    except UnsupportedFeatureError as error:
        outcome["hybrid"] = str(error)
    return outcome


def test_fsdp1_plugins_run_on_fsdp2_and_what_is_not_built_is_refused():
    outcome = run_on_ranks(_refusals_and_translation, 2, timeout=120)[0]
    assert outcome["translated"] == (2, False)
    assert "HYBRID_SHARD" in outcome["hybrid"] and "2-D" in outcome["hybrid"]
    assert "cpu_ram_efficient_loading" in outcome["ram"]


def test_one_process_with_a_plugin_trains_without_sharding_and_says_so():
    with pytest.warns(UserWarning, match="FSDP shards a model across processes and this job has one"):
        accelerator = fresh_accelerator()
    assert str(accelerator.distributed_type) == "DistributedType.NO" and not accelerator.is_fsdp2
