"""The Accelerator facade: prepare, backward, accumulate, and DDP training equal to one process."""

import collections

import pytest
import torch
from spawn_pool import run_on_ranks

from accel.accelerator import Accelerator
from accel.accelerator_config import DistributedDataParallelKwargs, GradientAccumulationPlugin
from accel.optimizer import AcceleratedOptimizer
from accel.scheduler import AcceleratedScheduler
from accel.unsupported import UnsupportedFeatureError


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def global_batches(count=6, size=8):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, size, 8, generator=generator)
    return inputs, inputs.sum(-1, keepdim=True).sin()


def _train(mixed_precision, accumulation):
    """Each rank trains on its slice of every global batch (split_batches=True: the scheduler steps once)."""
    accelerator = Accelerator(
        mixed_precision=mixed_precision, gradient_accumulation_steps=accumulation, split_batches=True
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    inputs, targets = global_batches()
    rank, world = accelerator.process_index, accelerator.num_processes
    steps_taken = 0
    for x, y in zip(inputs, targets):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
            accelerator.backward(loss)
            steps_taken += accelerator.sync_gradients
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    weights = {k: v.detach().float().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return weights, scheduler.get_last_lr(), steps_taken


@pytest.mark.parametrize("mixed_precision,atol", [("no", 1e-6), ("bf16", 2e-3)])  # measured: bf16 differs by <= 4e-4
@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_n_processes_end_where_one_process_ends(mixed_precision, atol, accumulation, world_size):
    (single,) = run_on_ranks(_train, 1, mixed_precision, accumulation)
    for weights, lr, steps in run_on_ranks(_train, world_size, mixed_precision, accumulation):
        assert steps == single[2] == 6 // accumulation
        assert lr == single[1] == [0.2 * 0.5**steps]
        for name, value in weights.items():
            torch.testing.assert_close(value, single[0][name], atol=atol, rtol=0, msg=name)


def test_accumulation_really_accumulates():
    # With 3 accumulation steps, weights after 3 batches equal one step on the mean of their gradients.
    accelerator = Accelerator(gradient_accumulation_steps=3)
    model, reference = make_model(), make_model()
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    model = accelerator.prepare(model)
    inputs, targets = global_batches(count=3)
    for x, y in zip(inputs, targets):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    full = torch.nn.functional.mse_loss(reference(inputs.flatten(0, 1)), targets.flatten(0, 1))
    full.backward()
    with torch.no_grad():
        for param in reference.parameters():
            param -= 0.5 * param.grad
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_backward_divides_the_loss_only_when_accumulating(monkeypatch, accumulation):
    # Dividing by 1 would change no value but add an op and a graph node to every step.
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    received = []
    monkeypatch.setattr(accelerator.precision, "backward", lambda loss, **kwargs: received.append(loss))
    loss = (torch.ones(2, requires_grad=True) * 3).sum()
    accelerator.backward(loss)
    if accumulation == 1:
        assert received == [loss] and received[0] is loss
    else:
        torch.testing.assert_close(received[0], loss / 3, atol=0, rtol=0)


def test_optimizer_zero_grad_reads_the_signature_once_and_passes_set_to_none_where_taken(monkeypatch):
    import inspect

    accelerator = Accelerator()
    model = make_model()
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    reads = []
    signature = inspect.signature
    monkeypatch.setattr(
        inspect,
        "signature",
        lambda function, *args, **kwargs: reads.append(function) or signature(function, *args, **kwargs),
    )
    for _ in range(3):
        model(torch.ones(1, 8)).sum().backward()
        optimizer.zero_grad()
        assert all(param.grad is None for param in model.parameters())  # torch's set_to_none=True default
    assert len(reads) <= 1  # an inspect.signature per step costs as much as zeroing a small model
    calls = []
    optimizer.optimizer.zero_grad = lambda: calls.append("no set_to_none")  # a zero_grad that does not take it
    optimizer.zero_grad(set_to_none=False)
    optimizer.optimizer.zero_grad = lambda set_to_none=True: calls.append(set_to_none)
    optimizer.zero_grad(set_to_none=False)
    optimizer.zero_grad()
    assert calls == ["no set_to_none", False, True]


def test_prepare_returns_wrappers_in_the_order_given():
    accelerator = Accelerator()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    prepared_scheduler, prepared_optimizer, prepared_model = accelerator.prepare(scheduler, optimizer, model)
    assert isinstance(prepared_optimizer, AcceleratedOptimizer) and isinstance(
        prepared_optimizer, torch.optim.Optimizer
    )
    assert isinstance(prepared_scheduler, AcceleratedScheduler) and prepared_scheduler.optimizers == [
        prepared_optimizer
    ]
    assert prepared_model is model and accelerator.prepare(model) is model


class DtypeProbe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        y = self.linear(x)
        self.seen.append(y.dtype)
        return y


def test_bf16_autocasts_the_forward_and_returns_fp32():
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(DtypeProbe())
    output = model(torch.randn(2, 4))
    assert model.seen == [torch.bfloat16] and output.dtype == torch.float32
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)(torch.randn(2, 4))
    assert model.seen[-1] == torch.float32  # the forward runs without autocast once unwrapped


def test_a_deep_copy_of_a_bf16_model_runs_its_own_weights():
    import copy

    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(torch.nn.Linear(3, 3))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    x = torch.randn(2, 3)
    assert twin(x).abs().sum() == 0 and model(x).abs().sum() > 0 and twin(x).dtype == torch.float32


def test_preparing_twice_returns_the_prepared_objects():
    accelerator = Accelerator()
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(8), batch_size=2))
    model = accelerator.prepare(make_model())
    assert accelerator.prepare(loader) is loader and accelerator.prepare(model) is model
    assert len(accelerator._dataloaders) == 1 and len(accelerator._models) == 1


def test_unsupported_precision_and_bad_arguments_are_clear_errors():
    with pytest.raises(UnsupportedFeatureError, match="FP8 training.*mixed_precision='fp8'"):
        Accelerator(mixed_precision="fp8")
    with pytest.raises(ValueError, match="only pass one DistributedDataParallelKwargs"):
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()])
    with pytest.raises(ValueError, match="not both"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))


def _hooked_ddp_training(hook):
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=hook)])
    model = accelerator.prepare(make_model())
    inputs, targets = global_batches(count=2)
    rank = accelerator.process_index  # different data per rank: equal grads prove the all-reduce ran
    accelerator.backward(torch.nn.functional.mse_loss(model(inputs[rank]), targets[rank]))
    return model._get_ddp_logging_data().get("comm_hook", ""), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "hook,name",
    [("fp16", "fp16_compress_hook"), ("power_sgd", "powerSGD_hook"), ("batched_power_sgd", "batched_powerSGD_hook")],
)  # bf16 compression needs NCCL
def test_ddp_communication_hooks_are_registered_and_reduce(hook, name):
    (hook_0, grads_0), (hook_1, grads_1) = run_on_ranks(_hooked_ddp_training, 2, hook)
    assert name in hook_0 and name in hook_1
    for mine, theirs in zip(grads_0, grads_1):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


def _trigger(rank_that_fires):
    accelerator = Accelerator()
    if accelerator.process_index == rank_that_fires:
        accelerator.set_trigger()
    return accelerator.check_trigger(), accelerator.check_trigger()


def test_a_trigger_set_on_one_rank_is_seen_on_all_once():
    assert run_on_ranks(_trigger, 2, 1) == [(True, False), (True, False)]


def _eval_pass(length, batch_size, even_batches, dispatch_batches):
    from accel.accelerator_config import DataLoaderConfiguration

    config = DataLoaderConfiguration(even_batches=even_batches, dispatch_batches=dispatch_batches)
    accelerator = Accelerator(dataloader_config=config)
    dataset = torch.utils.data.TensorDataset(torch.arange(length), torch.arange(length).float() * 2)
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=batch_size))
    seen, doubled, labels, widths = [], [], [], []
    for index, value in loader:
        names = [f"sample {i}" for i in index.tolist()]
        index, value = accelerator.gather_for_metrics((index, value))
        seen += index.tolist()
        doubled += value.tolist()
        labels += accelerator.gather_for_metrics(names, use_gather_object=True)
        widths.append(accelerator.pad_across_processes(torch.ones(1, accelerator.process_index + 1), dim=1).shape)
        accelerator.wait_for_everyone()
    return seen, doubled, labels, widths


# (length, batch size): even numbers of batches per process, and uneven ones (a last step that only some
# processes have, where the others stand by inside the loader) for 2 and 4 processes, sharded and dispatched.
@pytest.mark.parametrize("world_size,length,batch_size", [(2, 7, 2), (2, 5, 2), (4, 7, 2), (4, 9, 2)])
def test_gather_for_metrics_sees_every_sample_once_through_the_accelerator(world_size, length, batch_size):
    for even_batches in (True, False):
        for dispatch_batches in (False, True):
            case = dict(even_batches=even_batches, dispatch_batches=dispatch_batches)
            results = run_on_ranks(_eval_pass, world_size, length, batch_size, even_batches, dispatch_batches)
            seen, doubled, labels, _ = results[0]
            assert seen == list(range(length)), case
            assert doubled == [2.0 * i for i in range(length)], case
            assert labels == [f"sample {i}" for i in range(length)], case
            for rank_seen, _, _, widths in results:
                assert rank_seen == seen[: len(rank_seen)], case  # a rank standing by misses the last step
                assert {shape[1] for shape in widths[:-1]} <= {world_size}, case


def _collective_in_uneven_step(name):
    from accel.accelerator_config import DataLoaderConfiguration
    from accel.collectives import DistributedOperationException

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model, optimizer = accelerator.prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.randn(3, 8), batch_size=1))  # 2 + 1 batches
    steps = 0
    try:
        for batch in loader:
            steps += 1
            if name == "reduce":
                accelerator.reduce(batch.sum(), reduction="none")  # communicates nothing: allowed
                accelerator.reduce(batch.sum())
            else:
                accelerator.backward(model(batch).sum())  # DDP: its forward already communicates
    except DistributedOperationException as error:
        return steps, str(error)
    return steps, None


@pytest.mark.parametrize("name", ["reduce", "forward"])
def test_a_collective_that_needs_every_process_fails_on_all_in_an_uneven_last_step(name):
    (steps_0, error_0), (steps_1, error_1) = run_on_ranks(_collective_in_uneven_step, 2, name)
    assert (steps_0, steps_1) == (2, 1)
    assert error_0 == error_1 and "cannot run in the last step" in error_0 and name in error_0


def _disagreeing_last_step():
    from accel.accelerator_config import DataLoaderConfiguration
    from accel.collectives import DistributedOperationException

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(12), batch_size=2))  # 6 batches, 4 ranks
    try:
        for batch in loader:
            if not (accelerator.process_index == 1 and loader.end_of_dataloader):
                accelerator.gather_for_metrics(batch)
    except DistributedOperationException as error:
        return str(error)
    return None


def test_processes_that_disagree_in_an_uneven_last_step_all_raise():
    errors = run_on_ranks(_disagreeing_last_step, 4)
    assert errors == [errors[0]] * 4
    assert "process 0: gather, process 1: loop ended" in errors[0]


def test_skip_first_batches_through_the_accelerator():
    accelerator = Accelerator()
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(10), batch_size=3))
    skipped = accelerator.skip_first_batches(loader, num_batches=2)
    assert [batch.tolist() for batch in skipped] == [[6, 7, 8], [9]]


def test_clip_grad_norm_and_value_clip_like_torch():
    accelerator = Accelerator()
    model = accelerator.prepare(make_model())
    inputs, targets = global_batches(count=1)
    accelerator.backward(torch.nn.functional.mse_loss(model(inputs[0]) * 100, targets[0]))
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(0.5), atol=1e-5, rtol=0)
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 0.01


def test_dynamo_plugin_compiles_prepared_models(monkeypatch):
    from accel.accelerator_config import TorchDynamoPlugin

    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager", fullgraph=True))
    model = make_model()
    compiled = accelerator.prepare(model)
    assert hasattr(compiled, "_orig_mod") and accelerator.unwrap_model(compiled, keep_torch_compile=False) is model
    assert accelerator.unwrap_model(compiled) is compiled and compiled._orig_mod is model  # HF's default keeps it
    inputs, _ = global_batches(count=1)
    torch.testing.assert_close(compiled(inputs[0]), model(inputs[0]))


def test_dynamo_settings_come_from_the_launcher_env(monkeypatch):
    from accel.accelerator_config import TorchDynamoPlugin

    monkeypatch.setenv("ACCEL_DYNAMO_BACKEND", "EAGER")
    monkeypatch.setenv("ACCEL_DYNAMO_MODE", "reduce-overhead")
    monkeypatch.setenv("ACCEL_DYNAMO_USE_FULLGRAPH", "true")
    plugin = TorchDynamoPlugin()
    assert plugin.enabled and plugin.compile_kwargs() == {
        "backend": "eager",
        "fullgraph": True,
        "dynamic": None,
        "mode": "reduce-overhead",
    }


def test_get_logger_logs_on_the_main_process_with_hf_rank_prefix(caplog):
    from accel.logging import get_logger

    accelerator = Accelerator()
    logger = get_logger("accel.test", log_level="INFO")
    with caplog.at_level("INFO", logger="accel.test"):
        logger.info("only once", main_process_only=True)
        logger.info("from every process %s", "here", main_process_only=False)
        logger.info("in order", in_order=True)
        line = _current_line() + 1
        logger.warning_once("careful")
        logger.warning_once("careful")
    assert [r.getMessage() for r in caplog.records] == [
        "[RANK 0] only once",
        "[RANK 0] from every process here",
        "[RANK 0] in order",
        "[RANK 0] careful",
    ]
    assert {r.funcName for r in caplog.records} == {"test_get_logger_logs_on_the_main_process_with_hf_rank_prefix"}
    assert caplog.records[-1].lineno == line  # warning_once names its caller's line
    assert accelerator.is_main_process


def _current_line() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno


def _log_from_every_rank():
    import logging

    from accel.logging import get_logger
    from accel.state import PartialState

    PartialState()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = get_logger("accel.test.ranks", log_level="INFO")
    logger.logger.addHandler(handler)
    try:
        logger.info("main only")
        logger.info("every rank", main_process_only=False)
        logger.info("in turn", in_order=True)
    finally:
        logger.logger.removeHandler(handler)
    return records


def test_get_logger_prefixes_each_rank_as_hf_does():
    """HF Accelerate's MultiProcessAdapter writes `[RANK n] ` before every message, so ranks can be told apart."""
    assert run_on_ranks(_log_from_every_rank, 2) == [
        ["[RANK 0] main only", "[RANK 0] every rank", "[RANK 0] in turn"],
        ["[RANK 1] every rank", "[RANK 1] in turn"],
    ]


def test_save_writes_on_the_main_process(tmp_path):
    from safetensors.torch import load_file

    accelerator = Accelerator()
    state = {"weight": torch.arange(6.0).view(2, 3)}
    accelerator.save(state, tmp_path / "model.safetensors", safe_serialization=True)
    accelerator.save(state, tmp_path / "model.bin")
    assert torch.equal(load_file(tmp_path / "model.safetensors")["weight"], state["weight"])
    assert torch.equal(torch.load(tmp_path / "model.bin", weights_only=True)["weight"], state["weight"])


def test_free_memory_drops_the_references():
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    assert accelerator.free_memory(model, optimizer) == (None, None)
    assert accelerator._models == [] and accelerator._optimizers == [] and accelerator.step == 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="--multi_gpu needs 2 GPUs (HF and accel refuse 1 process)")
def test_example_trains_on_every_gpu(tmp_path):
    """accel launch --multi_gpu: the example runs one process per GPU with NCCL (a machine with 2+ GPUs)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "train.py"
    count = torch.cuda.device_count()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel",
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(count),
            "--mixed_precision",
            "bf16",
            str(example),
            "--epochs",
            "2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert f"training on {count} process(es) (DistributedType.MULTI_GPU)" in result.stdout  # even alone, as HF
    assert "over 1001 samples" in result.stdout


def _group_timeout():
    from datetime import timedelta

    from accel.accelerator_config import InitProcessGroupKwargs

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=77))])
    return accelerator.state.timeout.total_seconds()


def test_init_process_group_kwargs_set_the_group_timeout():
    assert run_on_ranks(_group_timeout, 2) == [77.0, 77.0]


def _first_step_gradients(sync_each_batch):
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    model = accelerator.prepare(make_model())
    inputs, targets = global_batches(count=1)
    x, y = inputs[0].chunk(2)[accelerator.process_index], targets[0].chunk(2)[accelerator.process_index]
    with accelerator.accumulate(model):  # step 1 of 2: not a sync step
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    return accelerator.sync_gradients, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sync_each_batch_all_reduces_while_accumulating(sync_each_batch):
    (sync_0, grads_0), (sync_1, grads_1) = run_on_ranks(_first_step_gradients, 2, sync_each_batch)
    assert not sync_0 and not sync_1  # still accumulating either way
    same = all(torch.equal(a, b) for a, b in zip(grads_0, grads_1))
    assert same == sync_each_batch  # ranks saw different data: only an all-reduce makes their grads equal


def test_autocast_kwargs_reach_the_forward():
    from accel.accelerator_config import AutocastKwargs

    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = accelerator.prepare(DtypeProbe())
    model(torch.randn(2, 4))
    assert model.seen == [torch.float32]  # enabled=False reached the wrapped forward
    with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=True)):
        assert model.linear(torch.randn(2, 4)).dtype == torch.bfloat16


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_regional_compilation_compiles_each_repeated_block_in_place():
    """`use_regional_compilation`: each repeated block (and each module without repeated blocks) is compiled in
    place, as HF does for FSDP2; the model keeps its class, tree and state-dict names, and computes the same."""
    from accel.accelerator_config import TorchDynamoPlugin

    torch.manual_seed(0)
    model, inputs = Blocks(), torch.randn(2, 4)
    expected = model(inputs)
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    prepared = accelerator.prepare(model)
    assert prepared is model and list(prepared.state_dict()) == list(Blocks().state_dict())
    compiled = [name for name, module in model.named_modules() if module._compiled_call_impl is not None]
    assert compiled == ["embed", "blocks.0", "blocks.1", "blocks.2"]
    torch.testing.assert_close(prepared(inputs), expected, rtol=0, atol=0)


def _ragged_metrics():
    accelerator = Accelerator()
    rank = accelerator.process_index
    encoding = collections.UserDict({"ids": torch.arange(rank + 1), "mask": torch.ones(rank + 1, dtype=torch.bool)})
    return accelerator.gather_for_metrics(encoding)


def test_gather_for_metrics_takes_any_mapping_and_uneven_lengths():
    for gathered in run_on_ranks(_ragged_metrics, 2):
        assert isinstance(gathered, collections.UserDict)  # a Mapping, not pickled objects (BatchEncoding is one)
        assert gathered["ids"].tolist() == [0, 0, 1] and gathered["mask"].tolist() == [True] * 3


def _native_calls_per_collective():
    """The shared-memory ops each public call makes, after a first gather has opened the group."""
    from accel import ops

    accelerator = Accelerator()
    rank = accelerator.process_index
    accelerator.gather(torch.zeros(1))
    calls = []
    # The direct path's entries (accel.collectives.direct) count as the ops they call.
    ops_and_entries = ("shm_all_gather", "shm_all_gather_bytes", "shm_pad_across_processes")
    for name in (*ops_and_entries, "shm_all_gather_direct", "shm_pad_across_processes_direct"):

        def recorded(group, data, *args, _name=name.removesuffix("_direct"), _op=getattr(ops, name), **kwargs):
            calls.append((_name, len(data) if isinstance(data, list) else 1))
            return _op(group, data, *args, **kwargs)

        setattr(ops, name, recorded)
    outputs = {"logits": torch.ones(rank + 2, 3), "labels": (torch.arange(rank + 2), [torch.tensor(1.0)])}
    per_call = []
    for collective in (
        lambda: accelerator.gather_for_metrics(outputs),
        lambda: accelerator.gather(accelerator.pad_across_processes(torch.ones(rank + 1))),
        lambda: accelerator.gather_for_metrics([f"rank {rank}"]),
    ):
        collective()
        per_call.append(list(calls))
        calls.clear()
    return per_call


@pytest.mark.native
def test_each_public_gather_is_one_native_call_per_call_for_all_its_leaves():
    for per_call in run_on_ranks(_native_calls_per_collective, 2):
        assert per_call == [
            [("shm_all_gather", 3)],
            [("shm_pad_across_processes", 1), ("shm_all_gather", 1)],
            [("shm_all_gather_bytes", 1)],
        ]
