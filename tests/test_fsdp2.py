"""FSDP2 through `Accelerator` on 2 CPU processes (issue 21): parity with DDP, sharded parameters, the fused clip
over shards, fp16 loss scaling with sharded gradients, what prepare sets up (tied weights, bf16's policy, activation
checkpointing, ignored modules), RAM-efficient loading from the main process, sharded save_state / load_state
(bit-identical resume, a different number of processes), the full state dict for save_model, and what is refused."""

import contextlib
import ctypes
import gc
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
    plugin = FullyShardedDataParallelPlugin(
        **{"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap", **(fsdp if isinstance(fsdp, dict) else {})}
    )
    return Accelerator(fsdp_plugin=plugin if fsdp else None, **kwargs)


def grad_kernels_loaded():
    from accel.precision import grads

    return grads.native_on("cpu")


def tiny_gpt2(seed=0, **config):
    config = transformers.GPT2Config(
        **{"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 97, "n_positions": 32, **config}
    )
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
    results["shards"] = (
        sum(local.values()),
        sum(whole.values()),
        all(isinstance(m, FSDPModule) for m in units),
        model.lm_head.weight is model.transformer.wte.weight,
    )
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


def _regional_compilation(steps):
    from accel.accelerator_config import TorchDynamoPlugin

    results = {}
    for regional in (False, True):
        plugin = TorchDynamoPlugin(backend="eager", use_regional_compilation=True) if regional else None
        accelerator = fresh_accelerator(dynamo_plugin=plugin)
        model, optimizer = prepared(accelerator)
        losses, norms = train(accelerator, model, optimizer, batches(accelerator.process_index, steps))
        compiled = [name for name, m in model.named_modules() if m._compiled_call_impl is not None]
        results[regional] = (losses, norms, compiled, type(model).__name__)
    return results


def test_regional_compilation_compiles_each_block_in_place_and_trains_as_without():
    """dynamo with use_regional_compilation under FSDP2: every GPT2Block compiled in place (one compiled code
    reused for each), the model still the sharded FSDP module (fully_shard's hooks run), the same losses."""
    for result in run_on_ranks(_regional_compilation, 2, 4, timeout=240):
        plain_losses, plain_norms, nothing, _ = result[False]
        losses, norms, compiled, kind = result[True]
        assert nothing == [] and kind == "FSDPGPT2LMHeadModel"
        assert {"transformer.h.0", "transformer.h.1"} <= set(compiled)
        torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norms, plain_norms, rtol=1e-5, atol=1e-6)


def _cpu_offload(steps):
    results = {}
    for offload in (False, True):
        accelerator = fresh_accelerator({"cpu_offload": offload})
        model, optimizer = prepared(accelerator)
        losses, norms = train(accelerator, model, optimizer, batches(accelerator.process_index, steps))
        results[offload] = (losses, norms, repr(accelerator.strategy.plugin.cpu_offload))
    return results


def test_cpu_offload_policy_trains_as_without():
    """`cpu_offload` (FSDP_OFFLOAD_PARAMS) gives fully_shard torch's CPUOffloadPolicy; on CPU processes the shards
    already live in CPU memory, so the losses and norms are those of the run without it."""
    for result in run_on_ranks(_cpu_offload, 2, 4, timeout=240):
        plain_losses, plain_norms, *_ = result[False]
        losses, norms, policy = result[True]
        assert "CPUOffloadPolicy" in policy
        torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norms, plain_norms, rtol=1e-5, atol=1e-6)


# --- 2-D meshes: hybrid sharding, NO_SHARD -----------------------------------------------------------------------

MESH_SETUPS = {
    # name: (FSDP plugin fields or False for DDP, ParallelismConfig sizes, LOCAL_WORLD_SIZE)
    "ddp": (False, None, None),
    "no_shard": (
        {"fsdp_version": 1, "sharding_strategy": "NO_SHARD", "state_dict_type": "SHARDED_STATE_DICT"},
        None,
        None,
    ),
    "hybrid": (
        {
            "fsdp_version": 1,
            "sharding_strategy": "HYBRID_SHARD",
            "state_dict_type": "SHARDED_STATE_DICT",
            "cpu_ram_efficient_loading": True,
        },
        None,
        2,
    ),  # the main process's weights sent into a 2-D mesh
    "hsdp": ({"fsdp_version": 2}, {"dp_replicate_size": 2, "dp_shard_size": 2}, None),
}


def _on_mesh(setups, steps, folder):
    from accel.backends.parallelism import ParallelismConfig

    results = {}
    for setup in setups:
        fsdp, sizes, local_world = MESH_SETUPS[setup]
        if local_world is not None:  # as if two machines of two processes each
            os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
        config = ParallelismConfig(**sizes) if sizes else None
        accelerator = fresh_accelerator(fsdp, gradient_accumulation_steps=2, parallelism_config=config)
        model, optimizer = prepared(accelerator)
        losses, norms = train(accelerator, model, optimizer, batches(accelerator.process_index, steps))
        mesh = getattr(accelerator.strategy, "mesh", None)
        groups = (
            []
            if mesh is None
            else [
                mesh.get_group(i)._get_backend(torch.device("cpu")).name() for i in range(mesh.ndim) if mesh.size(i) > 1
            ]
        )
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
        resumed = None
        if folder is not None and setup != "ddp":
            accelerator.save_state(os.path.join(folder, setup))
            straight = train(accelerator, model, optimizer, batches(accelerator.process_index, 2, seed=2))
            accelerator.load_state(os.path.join(folder, setup))
            resumed = (straight, train(accelerator, model, optimizer, batches(accelerator.process_index, 2, seed=2)))
        results[setup] = (losses, norms, None if mesh is None else tuple(mesh.shape), groups, local, resumed)
    return results


def _assert_mesh_runs_match_ddp(results, expected_meshes):
    whole = sum(p.numel() for p in tiny_gpt2().parameters())  # the tied lm_head once
    for result in results:
        ddp_losses, ddp_norms, *_ = result["ddp"]
        for setup, (shape, fraction) in expected_meshes.items():
            losses, norms, mesh, groups, local, resumed = result[setup]
            torch.testing.assert_close(losses, ddp_losses, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(norms, ddp_norms, rtol=1e-5, atol=1e-6)  # replicas not counted twice
            assert mesh == shape, setup
            assert abs(local - whole * fraction) <= 1024, (setup, local, whole)
            if resumed is not None:
                assert resumed[0] == resumed[1], setup  # a sharded checkpoint on a 2-D mesh resumes bit-identically
            if grad_kernels_loaded():  # every sub-group with more than one process shares memory, as the default one
                assert groups and set(groups) == {"accel"}, (setup, groups)


def test_no_shard_and_hybrid_shard_run_on_2d_meshes_as_ddp_does(tmp_path):
    """FSDP1's NO_SHARD (every process a replica) and HYBRID_SHARD on one machine (one replica sharded over
    both) on FSDP2's 2-D mesh: DDP's losses and clip norms over 12 steps, whole or half the parameters per process,
    and sharded save_state / load_state resuming bit-identically."""
    results = run_on_ranks(_on_mesh, 2, ["ddp", "no_shard", "hybrid"], 12, str(tmp_path), timeout=300)
    _assert_mesh_runs_match_ddp(results, {"no_shard": ((2, 1), 1.0), "hybrid": ((1, 2), 0.5)})


@pytest.mark.slow
def test_hsdp_on_four_processes_replicates_two_shards_as_ddp_does(tmp_path):
    """Hybrid sharding proper on 4 processes, from HF's ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) and
    from FSDP1's HYBRID_SHARD with two 'machines' of two processes: each process holds half the parameters
    (sharded within its replica pair), gradients are all-reduced across the pairs: DDP's losses and norms."""
    results = run_on_ranks(_on_mesh, 4, ["ddp", "hsdp", "hybrid"], 8, None, timeout=400)
    _assert_mesh_runs_match_ddp(results, {"hsdp": ((2, 2), 0.5), "hybrid": ((2, 2), 0.5)})


# --- what prepare sets up ----------------------------------------------------------------------------------------


def fsdp_groups(model):
    """The model's FSDP parameter groups, each once (the modules of a unit, e.g. the tail's, share one state)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {
        id(group): group
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    }
    return list(groups.values())


def _tied_weights_through_a_step():
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    embedding, head = model.transformer.wte, model.lm_head
    used = {}  # the weight each module computes with, gathered: one tensor for both
    for module in (embedding, head):
        module.register_forward_pre_hook(lambda m, args: used.setdefault(m, []).append(m.weight.data_ptr()))
    before = embedding.weight.to_local().clone()
    train(accelerator, model, optimizer, batches(accelerator.process_index, 1))
    holders = [group for group in fsdp_groups(model) for p in group.fsdp_params if p.sharded_param is head.weight]
    return {
        "same parameter": head.weight is embedding.weight,
        "same shard": head.weight.to_local().data_ptr() == embedding.weight.to_local().data_ptr(),
        "same gathered weight in the forward": used[embedding] == used[head],
        "one FSDP unit holds it": len(holders) == 1,
        "updated": not torch.equal(before, embedding.weight.to_local()),
    }


def test_tied_weights_stay_one_sharded_parameter_updated_once():
    """GPT-2's lm_head and wte: one sharded parameter (one storage, one FSDP unit), one gathered weight in the
    forward, updated by the step (its gradient, both uses summed, is checked against DDP in the first test)."""
    for facts in run_on_ranks(_tied_weights_through_a_step, 2, timeout=120):
        assert all(facts.values()), facts


def _bf16_policy():
    accelerator = fresh_accelerator(mixed_precision="bf16")
    model = tiny_gpt2().to(torch.bfloat16)  # as loaded in bf16: the trainable parameters become fp32 masters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    in_forward = set()
    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda m, args: in_forward.add(m.weight.dtype))
    losses, _ = train(accelerator, model, optimizer, batches(accelerator.process_index, 2))
    return {
        "policy": accelerator.strategy.plugin.mixed_precision_policy,
        "groups' policies": {group.mp_policy for group in fsdp_groups(model)},
        "in the forward": in_forward,
        "masters": {(type(p).__name__, p.dtype) for p in model.parameters()},
        "optimizer state": {
            t.dtype for state in optimizer.optimizer.state.values() for t in state.values() if t.dim() > 0
        },
        "losses": losses,
    }


def test_bf16_sets_hf_mixed_precision_policy_on_every_unit_and_keeps_fp32_masters():
    from accelerate.utils import FullyShardedDataParallelPlugin as HFPlugin

    hf = HFPlugin(fsdp_version=2)
    hf.set_mixed_precision("bf16")  # what HF's AcceleratorState does with mixed_precision="bf16"
    for outcome in run_on_ranks(_bf16_policy, 2, timeout=120):
        assert outcome["policy"] == hf.mixed_precision_policy
        assert outcome["policy"].param_dtype == outcome["policy"].reduce_dtype == torch.bfloat16
        assert outcome["groups' policies"] == {hf.mixed_precision_policy}
        assert outcome["in the forward"] == {torch.bfloat16}
        assert outcome["masters"] == {("DTensor", torch.float32)}
        assert outcome["optimizer state"] == {torch.float32}
        assert all(0 < loss < 10 for loss in outcome["losses"])


def _checkpointed_and_not():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    results = {}
    for checkpointing in (False, True):
        accelerator = fresh_accelerator({"activation_checkpointing": checkpointing})
        torch.manual_seed(0)
        model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # recomputing redraws dropout's masks
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        blocks = list(model.transformer.h)
        calls = []
        mlp = getattr(blocks[0], "_checkpoint_wrapped_module", blocks[0]).mlp
        forward = mlp.forward  # counted by a wrapper: torch's checkpoint recomputes without the module hooks
        mlp.forward = lambda *args: (calls.append(1), forward(*args))[1]
        losses, norms = train(accelerator, model, optimizer, batches(accelerator.process_index, 3))
        results[checkpointing] = {
            "wrapped": [(isinstance(b, CheckpointWrapper), isinstance(b, FSDPModule)) for b in blocks],
            "block forwards per step": len(calls) / 3,
            "run": (losses, norms, full_weights(accelerator, model)),
        }
    return results


def test_activation_checkpointing_recomputes_each_block_and_trains_the_same():
    for outcome in run_on_ranks(_checkpointed_and_not, 2, timeout=120):
        plain, checkpointed = outcome[False], outcome[True]
        assert plain["wrapped"] == [(False, True)] * 2 and checkpointed["wrapped"] == [(True, True)] * 2
        assert (plain["block forwards per step"], checkpointed["block forwards per step"]) == (1, 2)
        torch.testing.assert_close(checkpointed["run"], plain["run"], rtol=0, atol=0)


def _ignored_module_runs():
    from accel.big_modeling import init_empty_weights

    results = {}
    for setup in ("ddp", "fsdp", "fsdp, loaded from the main process"):
        efficient = setup.endswith("process")
        accelerator = fresh_accelerator(
            setup != "ddp" and {"ignored_modules": "transformer.wpe", "cpu_ram_efficient_loading": efficient}
        )
        with init_empty_weights() if efficient and not accelerator.is_main_process else contextlib.nullcontext():
            model = tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        wpe = accelerator.unwrap_model(model).transformer.wpe.weight
        torch.manual_seed(1)
        # The same batches on both processes: an ignored parameter's gradient is its process's own.
        run = train(accelerator, model, optimizer, batches(0, 3))
        tokens = batches(0, 1, seed=1)[0]
        accelerator.backward(model(tokens, labels=tokens).loss)
        max_norm = float(accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf")))
        results[setup] = (type(wpe).__name__, tuple(wpe.shape), (*run, max_norm), wpe.detach().clone())
    return results


def test_ignored_modules_stay_whole_and_unsharded_and_train_as_ddp():
    """A plugin's ignored_modules (a regex of names) stay plain, whole parameters, also when loaded from the main
    process; with the same batches on both processes the losses and clip norms (2 and inf) are DDP's: the ignored
    parameter's gradient counted once, with or without the fused clip."""
    for outcome in run_on_ranks(_ignored_module_runs, 2, timeout=120):
        _, _, ddp_run, ddp_wpe = outcome["ddp"]
        for setup in ("fsdp", "fsdp, loaded from the main process"):
            kind, shape, run, wpe = outcome[setup]
            assert (kind, shape) == ("Parameter", (32, 32))
            torch.testing.assert_close((run, wpe), (ddp_run, ddp_wpe), rtol=1e-5, atol=1e-6)


# --- loading -----------------------------------------------------------------------------------------------------


def wide_gpt2(seed=0):
    """About 24 MiB of fp32 weights in 100 tensors of at most 1 MiB: enough for a process's RSS to tell a full copy."""
    config = transformers.GPT2Config(n_layer=8, n_embd=256, n_head=4, vocab_size=97, n_positions=32)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _build_and_prepare_measured(efficient):
    """(MiB the process's peak RSS grew by while building and preparing the model, the prepared model, optimizer)."""
    from accel.big_modeling import init_empty_weights

    accelerator = fresh_accelerator({"cpu_ram_efficient_loading": efficient})
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    # glibc moves its mmap threshold up to the largest block this process freed so far (this worker ran other tests
    # before): set back to its starting 128 KiB, blocks above it are mapped and unmapped, and the peak counts the
    # tensors the model holds, not the freed broadcast buffers malloc kept in its heap.
    libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10)
    libc.malloc_trim(0)  # freed memory goes back to the system: new tensors count again
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
    start = _kib("VmRSS")
    on_meta = efficient and not accelerator.is_main_process
    with init_empty_weights() if on_meta else contextlib.nullcontext():
        model = wide_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    growth = (_kib("VmHWM") - start) / 1024
    # A fixed 128 KiB threshold would fault every larger block in and out for the rest of this worker's tests (the
    # pool's later tests ran 3x slower); 32 MiB is where glibc's own adjustment stops.
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    return growth, accelerator, model, optimizer


def _ram_efficient_and_plain():
    results = {}
    for efficient in (False, True):  # the plain run first: it pays for the first imports
        growth, accelerator, model, optimizer = _build_and_prepare_measured(efficient)
        tied = model.lm_head.weight is model.transformer.wte.weight
        torch.manual_seed(1)  # for dropout: a model built on the meta device draws no random numbers
        losses, norms = train(accelerator, model, optimizer, batches(accelerator.process_index, 2))
        results[efficient] = (growth, tied, losses, norms, full_weights(accelerator, model))
        results["MiB"] = sum(p.numel() * 4 for p in model.parameters()) / 2**20  # DTensors: the full numel
        del accelerator, model, optimizer
    return results


def test_cpu_ram_efficient_loading_keeps_the_full_weights_on_the_main_process_only():
    """cpu_ram_efficient_loading: process 1 builds its model on meta and gets its shards from process 0, its peak
    RSS growing by less than one copy of the weights (its plain run: more); training is the same as without it."""
    for rank, result in enumerate(run_on_ranks(_ram_efficient_and_plain, 2, timeout=180)):
        weights_mib = result["MiB"]
        (efficient_growth, efficient_tied, *efficient_run), (plain_growth, plain_tied, *plain_run) = (
            result[True],
            result[False],
        )
        assert efficient_tied and plain_tied
        # The same losses, clip norms and full weights (on the main process), bit for bit.
        torch.testing.assert_close(efficient_run, plain_run, rtol=0, atol=0)
        if rank == 1:
            assert efficient_growth < plain_growth and weights_mib < plain_growth, (efficient_growth, plain_growth)
            # Under one copy of the weights. Over gloo (no native backend) the peak also holds what malloc keeps
            # of the freed broadcast buffers (measured 26-27 MiB for 24 MiB of weights; 14 over shared memory).
            if grad_kernels_loaded():
                assert efficient_growth < weights_mib, (efficient_growth, weights_mib)


class Buffered(torch.nn.Module):
    """Two linear layers, a persistent buffer (in the state dict: loaded) and a non-persistent one (computed)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        self.register_buffer("shift", torch.zeros(8))
        self.register_buffer("mask", torch.arange(8.0) % 2, persistent=False)

    def forward(self, x):
        return (self.body(x) + self.shift) * self.mask


def _buffers_loaded_from_the_main_process():
    from accel.big_modeling import init_empty_weights

    results = {}
    for efficient in (False, True):
        accelerator = fresh_accelerator(
            {"cpu_ram_efficient_loading": efficient, "auto_wrap_policy": "size_based_wrap", "min_num_params": 100}
        )
        torch.manual_seed(0)
        if efficient and not accelerator.is_main_process:
            with init_empty_weights():
                model = Buffered()
        else:
            model = Buffered()
            model.shift.fill_(0.5)  # as a checkpoint would hold it
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
        losses = []
        for _ in range(2):
            loss = model(inputs).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results[efficient] = (buffers, losses)
    return results


def test_cpu_ram_efficient_loading_takes_the_main_process_buffers_and_keeps_computed_ones():
    """A persistent buffer comes from the main process (process 1's own value differs); a non-persistent one, not in
    the state dict, stays as each process computed it; training is the same as without the option."""
    for outcome in run_on_ranks(_buffers_loaded_from_the_main_process, 2, timeout=120):
        buffers, losses = outcome[True]
        assert torch.equal(buffers["shift"], torch.full((8,), 0.5))
        assert torch.equal(buffers["mask"], torch.arange(8.0) % 2)
        torch.testing.assert_close(outcome[True], outcome[False], rtol=0, atol=0)


def _loading_into_a_different_model():
    accelerator = fresh_accelerator({"cpu_ram_efficient_loading": True})
    model = tiny_gpt2(n_layer=2 + accelerator.process_index)  # process 1's has a third block
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    except ValueError as error:
        return str(error)


def test_cpu_ram_efficient_loading_into_models_that_differ_is_refused_on_every_process():
    for message in run_on_ranks(_loading_into_a_different_model, 2, timeout=120):
        assert message is not None and "the processes' models differ" in message, message
    assert "('transformer.h.2.ln_1.weight', (32,), torch.float32) where the main process has" in message


def _loaded_from_the_main_process_with_checkpointing_and_bf16():
    from accel.big_modeling import init_empty_weights

    results = {}
    for efficient in (False, True):
        accelerator = fresh_accelerator(
            {"cpu_ram_efficient_loading": efficient, "activation_checkpointing": True}, mixed_precision="bf16"
        )
        with init_empty_weights() if efficient and not accelerator.is_main_process else contextlib.nullcontext():
            model = tiny_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        tied = model.lm_head.weight is model.transformer.wte.weight
        run = train(accelerator, model, optimizer, batches(accelerator.process_index, 3))
        results[efficient] = (tied, {p.dtype for p in model.parameters()}, run, full_weights(accelerator, model))
    return results


def test_cpu_ram_efficient_loading_under_checkpointing_and_bf16_trains_as_without_it():
    """The checkpoint wrapper's names, the fp32 upcast of a bf16 model and the tied weights, loaded from the main
    process: the same training, bit for bit."""
    for outcome in run_on_ranks(_loaded_from_the_main_process_with_checkpointing_and_bf16, 2, timeout=120):
        assert outcome[True][:2] == outcome[False][:2] == (True, {torch.float32})
        torch.testing.assert_close(outcome[True][2:], outcome[False][2:], rtol=0, atol=0)


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
    optimizer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: stepped_types.append(
            sorted({type(p).__name__ for group in opt.param_groups for p in group["params"]})
        )
    )
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
    layouts = all(
        isinstance(values[key], DTensor)
        and values[key].placements == param.placements
        and values[key].shape == param.shape
        for param, values in state
        for key in state_names
    )
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


def _default_save_fsyncs(folder):
    import threading

    from accel.checkpoint import background

    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    train(accelerator, model, optimizer, batches(accelerator.process_index, 1))
    synced, real = [], os.fsync
    os.fsync = lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1]
    try:
        gate = threading.Event()
        background.saves.submit(gate.wait, "a test holding the worker")
        published = accelerator.save_state(folder)
        on_return = list(synced)
        gate.set()
        accelerator.wait_for_checkpoint()
    finally:
        os.fsync = real
    dcp_files = [
        os.path.join(root, name)
        for root, _, names in os.walk(published)
        for name in names
        if os.path.basename(root).startswith(("pytorch_model_fsdp_", "optimizer_"))
    ]
    return on_return, [path for path in dcp_files if path not in synced], len(dcp_files)


def test_a_default_sharded_save_waits_for_no_fsync_and_is_made_durable_in_the_background(tmp_path):
    """The default mode (complete on return, made durable by the background worker) holds for DCP's folders:
    no process fsyncs in the call (DCP's writer would); the main process's worker then fsyncs every DCP file,
    every process's shards and the .metadata."""
    results = run_on_ranks(_default_save_fsyncs, 2, str(tmp_path / "state"), timeout=180)
    assert [on_return for on_return, _, _ in results] == [[], []]
    _, unsynced, files = results[0]
    assert unsynced == [] and files == 6  # 2 folders x (2 processes' shards + .metadata)


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


def _saved_twice_beside_the_users_files(folder):
    accelerator = fresh_accelerator()
    model, optimizer = prepared(accelerator)
    if accelerator.is_main_process:
        os.makedirs(folder)
        with open(os.path.join(folder, "logs.txt"), "w") as logs:
            logs.write("the user's")
    accelerator.wait_for_everyone()
    for seed in range(2):  # the second save replaces the sharded-state folders of the first
        train(accelerator, model, optimizer, batches(accelerator.process_index, 1, seed))
        accelerator.save_state(folder)
    saved = full_weights(accelerator, model)
    train(accelerator, model, optimizer, batches(accelerator.process_index, 1, seed=2))
    accelerator.load_state(folder)
    loaded = full_weights(accelerator, model)
    return sorted(os.listdir(folder)), all(torch.equal(saved[name], loaded[name]) for name in saved)


def test_a_sharded_checkpoint_saved_again_into_a_folder_with_other_files_keeps_them(tmp_path):
    folder = str(tmp_path / "state")
    for listing, resumed in run_on_ranks(_saved_twice_beside_the_users_files, 2, folder, timeout=240):
        assert resumed
        assert {"logs.txt", "pytorch_model_fsdp_0", "optimizer_0"} <= set(listing)
    assert (tmp_path / "state" / "logs.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["state"]


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
        accelerator = fresh_accelerator(
            {"fsdp_version": 1, "sharding_strategy": "SHARD_GRAD_OP", "auto_wrap_policy": "transformer_based_wrap"}
        )
    outcome["translated"] = (
        accelerator.strategy.plugin.fsdp_version,
        accelerator.strategy.plugin.reshard_after_forward,
    )
    try:
        fresh_accelerator({"fsdp_version": 1, "backward_prefetch": "BACKWARD_POST"})
    except UnsupportedFeatureError as error:
        outcome["refused"] = str(error)
    return outcome


def test_fsdp1_plugins_run_on_fsdp2_and_what_fsdp2_cannot_do_is_refused():
    outcome = run_on_ranks(_refusals_and_translation, 2, timeout=120)[0]
    assert outcome["translated"] == (2, False)
    assert "BACKWARD_POST" in outcome["refused"] and "backward_prefetch" in outcome["refused"]


def test_one_process_with_a_plugin_trains_without_sharding_and_says_so():
    with pytest.warns(UserWarning, match="FSDP shards a model across processes and this job has one"):
        accelerator = fresh_accelerator()
    assert str(accelerator.distributed_type) == "DistributedType.NO" and not accelerator.is_fsdp2
