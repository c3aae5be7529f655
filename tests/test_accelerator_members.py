"""HF Accelerate's Accelerator / state members: class-level methods, handler attributes, properties, LOMO,
stateful dataloaders, precision helpers and enums."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from spawn_pool import run_on_ranks

from accel import Accelerator
from accel.accelerator_config import (
    AutocastKwargs,
    ComputeEnvironment,
    CustomDtype,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FP8BackendType,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    PrecisionType,
    ProfileKwargs,
    SageMakerDistributedType,
)
from accel.precision.hf_helpers import get_grad_scaler, get_mixed_precision_context_manager
from accel.precision.scaler import FusedGradScaler
from accel.state import AcceleratorState, DistributedType, GradientState, PartialState


def test_process_members_are_methods_of_the_class():
    for name in (
        "on_main_process",
        "on_local_main_process",
        "on_last_process",
        "on_process",
        "on_local_process",
        "wait_for_everyone",
        "print",
        "main_process_first",
        "local_main_process_first",
        "split_between_processes",
        "trigger_sync_in_backward",
        "join_uneven_inputs",
        "profile",
    ):
        assert callable(getattr(Accelerator, name)), name


def _decorated_calls():
    accelerator = Accelerator()

    class Worker:
        @Accelerator.on_main_process  # unbound, in a class body
        def report(self):
            return "main"

    calls = {
        "main": accelerator.on_main_process(lambda: "main")(),
        "local_main": accelerator.on_local_main_process(lambda: "local")(),
        "last": accelerator.on_last_process(lambda: "last")(),
        "process_1": accelerator.on_process(process_index=1)(lambda: "one")(),
        "local_1": accelerator.on_local_process(local_process_index=1)(lambda: "one")(),
        "method": Worker().report(),
    }
    with accelerator.split_between_processes(["a", "b", "c"], apply_padding=True) as shard:
        calls["shard"] = shard
    with accelerator.main_process_first():
        accelerator.wait_for_everyone()  # the main process is inside alone; nobody waits here for it
    return calls


def test_process_decorators_on_two_ranks():
    first, second = run_on_ranks(_decorated_calls, 2)
    assert first == {
        "main": "main",
        "local_main": "local",
        "last": None,
        "process_1": None,
        "local_1": None,
        "method": "main",
        "shard": ["a", "b"],
    }
    assert second == {
        "main": None,
        "local_main": None,
        "last": "last",
        "process_1": "one",
        "local_1": "one",
        "method": None,
        "shard": ["c", "c"],
    }


def test_decorators_run_everywhere_in_one_process_and_need_a_function():
    accelerator = Accelerator()
    assert accelerator.on_last_process(lambda: 1)() == 1 and accelerator.on_process(lambda: 2, process_index=5)() == 2
    with pytest.raises(ValueError, match="`on_main_process` decorator must be called with a function"):
        accelerator.on_main_process()


def test_handler_attributes():
    handlers = [
        DistributedDataParallelKwargs(bucket_cap_mb=10),
        GradScalerKwargs(init_scale=8.0),
        AutocastKwargs(),
        InitProcessGroupKwargs(),
        ProfileKwargs(record_shapes=True),
    ]
    accelerator = Accelerator(kwargs_handlers=handlers, mixed_precision="fp16")
    attributes = ("ddp_handler", "scaler_handler", "autocast_handler", "init_handler", "profile_handler")
    assert [getattr(accelerator, name) for name in attributes] == handlers
    for name in ("fp8_recipe_handler", "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler"):
        assert getattr(accelerator, name) is None
    assert not (accelerator.has_fp8_handler or accelerator.fp8_enabled or accelerator.has_lomo_optimizer)
    assert accelerator.native_amp and accelerator.scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match="Unsupported kwargs handler DataLoaderConfiguration"):
        Accelerator(kwargs_handlers=[DataLoaderConfiguration()])


def test_arguments_are_checked_as_hf():
    with pytest.raises(ValueError, match="Unknown mixed_precision mode: fp12"):
        Accelerator(mixed_precision="fp12")
    with pytest.raises(ValueError, match="both `dynamo_plugin` and `dynamo_backend`"):
        from accel.accelerator_config import TorchDynamoPlugin

        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin())
    assert Accelerator(mixed_precision=PrecisionType.BF16).mixed_precision == "bf16"


def test_properties_single_process(monkeypatch):
    config = DataLoaderConfiguration(dispatch_batches=False, use_seedable_sampler=True, non_blocking=True)
    accelerator = Accelerator(dataloader_config=config)
    assert (
        accelerator.dispatch_batches,
        accelerator.use_seedable_sampler,
        accelerator.non_blocking,
        accelerator.use_stateful_dataloader,
    ) == (False, True, True, False)
    accelerator.even_batches = False
    assert accelerator.dataloader_config.even_batches is False and config.even_batches is True  # a copy
    accelerator.sync_gradients = False
    assert GradientState().sync_gradients is False
    assert (
        not accelerator.multi_device and not accelerator.is_fsdp2 and not accelerator.is_composable_parallelism_enabled
    )
    assert accelerator.deepspeed_plugin is None and accelerator.parallelism_config is None
    assert accelerator.torch_device_mesh is None and accelerator.should_save_model
    assert accelerator.fp8_backend is FP8BackendType.NO
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")
    assert accelerator.fp8_backend is FP8BackendType.TE
    loader = torch.utils.data.DataLoader(range(4))
    assert accelerator.deepspeed_ulysses_dl_adapter(loader, torch.nn.Linear(1, 1)) is loader
    buffer = torch.arange(6.0).view(1, 6)
    with accelerator.maybe_context_parallel(buffers=[buffer], buffer_seq_dims=[1]):
        assert buffer.shape == (1, 6)  # nothing sharded without context parallelism


def test_verify_device_map():
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert not accelerator.verify_device_map(model)
    model[1].hf_device_map = {"0": "cpu"}
    assert not accelerator.verify_device_map(model)
    model[1].hf_device_map = {"0": "cpu", "1": "disk"}
    assert accelerator.verify_device_map(model)


def _ranks():
    accelerator = Accelerator()
    return (
        accelerator.data_parallel_rank,
        accelerator.data_parallel_shard_rank,
        accelerator.tensor_parallel_rank,
        accelerator.pipeline_parallel_rank,
        accelerator.context_parallel_rank,
        accelerator.multi_device,
    )


def test_parallel_ranks_under_ddp():
    assert run_on_ranks(_ranks, 2) == [(0, 0, 0, 0, 0, False), (1, 0, 0, 0, 0, False)]


def test_state_members():
    state = PartialState()
    device = state.device
    state.set_device()
    assert state.device == device
    del state.__dict__["device"]
    state.set_device()
    assert state.device == device
    gradients = GradientState()
    assert gradients.is_xla_gradients_synced is False
    gradients.is_xla_gradients_synced = True
    assert gradients.is_xla_gradients_synced is True
    assert AcceleratorState(_from_accelerator=True).is_fsdp2 is False


# --- LOMO (lomo_optim is not installed here: a stand-in module with its two classes) ------------------------


class _Lomo(torch.optim.Optimizer):
    """Updates each weight in its backward, as lomo_optim's Lomo does (fused_backward(loss, lr))."""

    def __init__(self, params):
        super().__init__(params, {})
        self.fused_calls = []

    def fused_backward(self, loss, lr):
        self.fused_calls.append(lr)
        loss.backward()
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    param -= lr * param.grad
                    param.grad = None


def test_lomo_backward(monkeypatch):
    accelerator = Accelerator()
    with pytest.raises(ImportError, match="lomo_optim"):
        accelerator.lomo_backward(torch.tensor(1.0), 0.1)
    monkeypatch.setitem(sys.modules, "lomo_optim", types.SimpleNamespace(Lomo=_Lomo, AdaLomo=type("AdaLomo", (), {})))
    monkeypatch.setattr("accel.availability.is_lomo_available", lambda: True)
    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    model, optimizer = accelerator.prepare(model, _Lomo(model.parameters()))
    assert accelerator.has_lomo_optimizer
    loss = model(torch.ones(1, 2)).sum()
    accelerator.backward(loss, learning_rate=0.5)
    optimizer.step()  # a no-op: the update happened in the backward
    assert optimizer.optimizer.fused_calls == [0.5]
    torch.testing.assert_close(model.weight.detach(), before - 0.5)
    with pytest.raises(ValueError, match="A learning rate must be passed"):
        accelerator.lomo_backward(loss, None)
    accelerator._optimizers.clear()
    with pytest.raises(ValueError, match="Are you sure you passed a LOMO optimizer"):
        accelerator.lomo_backward(model(torch.ones(1, 2)).sum(), 0.1)


# --- stateful dataloaders (torchdata) ---------------------------------------------------------------------------


def _resume(use_stateful: bool, stop_after: int, length: int = 10):
    config = DataLoaderConfiguration(use_stateful_dataloader=use_stateful)
    accelerator = Accelerator(dataloader_config=config)
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(length), batch_size=1))
    seen, state = [], None
    for step, batch in enumerate(loader):
        seen.append(batch.item())
        if step + 1 == stop_after:
            state = loader.state_dict()
            break
    resumed = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(length), batch_size=1))
    resumed.load_state_dict(state)
    return seen, [batch.item() for batch in resumed], resumed.iteration


def test_stateful_dataloader_resumes_mid_epoch_and_at_its_end():
    pytest.importorskip("torchdata.stateful_dataloader")
    assert _resume(True, 3) == ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9], 1)
    assert _resume(True, 10) == (list(range(10)), list(range(10)), 2)  # the next epoch, numbered 1


def test_stateful_dataloader_on_two_ranks():
    pytest.importorskip("torchdata.stateful_dataloader")
    first, second = run_on_ranks(_resume, 2, True, 2)
    assert first == ([0, 2], [4, 6, 8], 1) and second == ([1, 3], [5, 7, 9], 1)


def test_stateful_dataloader_without_torchdata_is_a_clear_error(monkeypatch):
    for name in ("torchdata", "torchdata.stateful_dataloader"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import torchdata...` fail
    monkeypatch.delitem(sys.modules, "accel.data.stateful", raising=False)
    with pytest.raises(ImportError, match="use_stateful_dataloader=True needs torchdata"):
        _resume(True, 1)


# --- precision helpers and enums --------------------------------------------------------------------------------


def test_mixed_precision_context_manager():
    Accelerator(mixed_precision="bf16")
    with get_mixed_precision_context_manager(native_amp=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    with get_mixed_precision_context_manager(native_amp=True, autocast_kwargs=AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with get_mixed_precision_context_manager(native_amp=False):
        assert not torch.is_autocast_enabled("cpu")


def test_grad_scaler():
    scaler = get_grad_scaler(init_scale=16.0)
    assert isinstance(scaler, FusedGradScaler) and scaler.is_enabled() and scaler.get_scale() == 16.0
    assert get_grad_scaler(DistributedType.MULTI_CPU).is_enabled()


def test_enums_as_hf():
    assert "fp16" in PrecisionType and "fp12" not in PrecisionType and str(PrecisionType.BF16) == "bf16"
    assert PrecisionType.list() == ["no", "fp8", "fp16", "bf16"]
    assert [member.value for member in CustomDtype] == ["fp8", "int4", "int2"]
    assert ComputeEnvironment("AMAZON_SAGEMAKER") is ComputeEnvironment.AMAZON_SAGEMAKER
    assert SageMakerDistributedType.DATA_PARALLEL == "DATA_PARALLEL"
