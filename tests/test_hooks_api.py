"""accel.hooks (HF's `accelerate.hooks` names): model offload for pipelines, layerwise casting, the attach_* helpers
and set_module_tensor_to_device's HF arguments."""

import pytest
import torch
from torch import nn

import accel.hooks
from accel.big_modeling import align_module_device, cpu_offload, cpu_offload_with_hook, has_offloaded_params
from accel.hooks import (
    AlignDevicesHook,
    CpuOffload,
    LayerwiseCastingHook,
    UserCpuOffloadHook,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_layerwise_casting_hooks,
    remove_hook_from_submodules,
    set_module_tensor_to_device,
)
from accel.unsupported import UnsupportedFeatureError

HF_HOOKS_NAMES = [  # what `accelerate.hooks` defines (1.15)
    "AlignDevicesHook",
    "CpuOffload",
    "LayerwiseCastingHook",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "set_module_tensor_to_device",
]


def test_hf_hooks_names_resolve():
    assert [name for name in HF_HOOKS_NAMES if not hasattr(accel.hooks, name)] == []


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))


# --- cpu_offload_with_hook -------------------------------------------------------------------------------------


class Stage(nn.Module):
    """Multiplies by a weight; its location is simulated (CPU-only CI has no second device): `.to(device)` records
    the device instead of copying, and `parameters()` report it. Only the CpuOffload logic is under test here; the
    GPU test below moves real models."""

    def __init__(self, factor, moves):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(float(factor)))
        self.location = torch.device("cpu")
        self.moves = moves

    def to(self, device):
        self.location = torch.device(device)
        self.moves.append((self.factor.item(), str(self.location)))
        return self

    def parameters(self, recurse=True):
        yield self.factor.detach().to(self.location)

    def forward(self, x):
        return x * self.factor.detach().to(x.device)


def test_cpu_offload_with_hook_keeps_one_model_of_the_chain_on_the_device():
    moves = []
    first, second = Stage(2, moves), Stage(3, moves)
    first, hook_1 = cpu_offload_with_hook(first, "meta")
    second, hook_2 = cpu_offload_with_hook(second, "meta", prev_module_hook=hook_1)
    assert isinstance(hook_2, UserCpuOffloadHook) and isinstance(hook_2.hook, CpuOffload)
    assert moves == [(2.0, "cpu"), (3.0, "cpu")]  # attaching offloads
    hidden = first(torch.ones(2))
    assert hidden.device.type == "meta" and moves[-1] == (2.0, "meta")
    moves.clear()
    for _ in range(3):  # the second model moves once and stays; the first is sent back to the CPU before it runs
        second(hidden)
    assert moves == [(2.0, "cpu"), (3.0, "meta")]
    hook_2.offload()
    assert moves[-1] == (3.0, "cpu")
    hook_1.remove()
    assert not hasattr(first, "_hf_hook") and first(torch.ones(2)).tolist() == [2.0, 2.0]


def test_cpu_offload_with_hook_on_the_cpu_keeps_outputs():
    model = make_model()
    x = torch.randn(3, 4)
    expected = model(x)
    model, hook = cpu_offload_with_hook(model, "cpu")
    torch.testing.assert_close(model(x), expected)
    hook.remove()
    assert "forward" not in model.__dict__


@pytest.mark.gpu
def test_cpu_offload_with_hook_moves_real_models_on_a_gpu():
    first, second = make_model(), nn.Linear(2, 3)
    x = torch.randn(5, 4)
    expected = second(first(x))
    first, hook_1 = cpu_offload_with_hook(first, 0)
    second, hook_2 = cpu_offload_with_hook(second, 0, prev_module_hook=hook_1)
    hidden = first(x)
    assert next(first.parameters()).is_cuda and not next(second.parameters()).is_cuda
    out = second(hidden)
    assert not next(first.parameters()).is_cuda and next(second.parameters()).is_cuda
    torch.testing.assert_close(out.cpu(), expected)
    hook_2.offload()
    assert not next(second.parameters()).is_cuda


# --- layerwise casting -----------------------------------------------------------------------------------------


def test_layerwise_casting_stores_small_computes_large_and_skips_what_is_asked():
    model, rounded = make_model(), make_model()
    rounded[0].to(torch.bfloat16).to(torch.float32)  # what storing the first layer in bf16 does to its weights
    x = torch.randn(3, 4)
    attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32, skip_modules_pattern="^3$")
    assert isinstance(model[0]._hf_hook, LayerwiseCastingHook) and model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # a LayerNorm is not cast
    assert model[3].weight.dtype == torch.float32  # skipped by name (one string is one pattern)
    out = model(x)
    assert out.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16  # cast back after the forward
    torch.testing.assert_close(out, rounded(x), atol=0, rtol=0)


def test_layerwise_casting_skips_classes():
    model = make_model()
    attach_layerwise_casting_hooks(model, torch.float16, torch.float32, skip_modules_classes=(nn.Linear,))
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --- attach_* ----------------------------------------------------------------------------------------------------


def test_attach_align_device_hook_offloads_every_module_and_gives_weights_back():
    model = make_model()
    x = torch.randn(3, 4)
    expected = model(x)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=weights)
    assert has_offloaded_params(model[0]) and not has_offloaded_params(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    torch.testing.assert_close(model(x), expected)
    assert all(p.device.type == "meta" for p in model.parameters())  # dropped again after the forward
    with align_module_device(model[0]):
        torch.testing.assert_close(model[0].weight, weights["0.weight"])
    assert model[0].weight.device.type == "meta"
    remove_hook_from_submodules(model)
    torch.testing.assert_close(model(x), expected)


def test_attach_align_device_hook_on_blocks_offloads_only_the_blocks_asked():
    model = make_model()
    x = torch.randn(3, 4)
    expected = model(x)
    blocks = ["0", "1", "2", "3"]
    attach_align_device_hook_on_blocks(
        model,
        execution_device=dict.fromkeys(blocks, "cpu"),
        offload={"0": False, "1": False, "2": False, "3": True},
        weights_map=dict(model.state_dict()),
    )
    assert model[3].weight.device.type == "meta" and model[0].weight.device.type == "cpu"
    torch.testing.assert_close(model(x), expected)


def test_cpu_offload_preloads_modules_that_use_a_child_weight_directly():
    class UsesChildWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(4, 4)

        def forward(self, x):  # never calls self.dense
            return x @ self.dense.weight.T + self.dense.bias

    model = nn.Sequential(UsesChildWeight(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    cpu_offload(model, "cpu", preload_module_classes=["UsesChildWeight"])
    torch.testing.assert_close(model(x), expected)


# --- set_module_tensor_to_device ---------------------------------------------------------------------------------


def test_set_module_tensor_to_device_reuses_tied_copies_and_checks_its_input():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    shared = torch.randn(3, 3)
    tied = {shared.data_ptr(): {}}
    set_module_tensor_to_device(a, "weight", "cpu", value=shared, tied_params_map=tied)
    set_module_tensor_to_device(b, "weight", "cpu", value=shared, tied_params_map=tied)
    assert a.weight is b.weight and tied[shared.data_ptr()]["cpu"] is a.weight
    before = a.bias
    set_module_tensor_to_device(a, "bias", "cpu")
    assert a.bias is before  # already there: the same parameter object
    with pytest.raises(ValueError, match="shape"):
        set_module_tensor_to_device(a, "weight", "cpu", value=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="neither a parameter nor a buffer"):
        set_module_tensor_to_device(a, "scale", "cpu")
    with pytest.raises(UnsupportedFeatureError, match="fp16_statistics"):
        set_module_tensor_to_device(a, "weight", "cpu", value=shared, fp16_statistics=torch.ones(3))


class Recording(nn.Linear):
    """Calls `record(self)` at the start of its forward (after the hooks brought the weight in)."""

    def __init__(self, record):
        super().__init__(3, 3, bias=False)
        self.record = record

    def forward(self, x):
        self.record(self)
        return super().forward(x)


def test_an_offloaded_tied_weight_reuses_the_copy_already_on_the_device():
    seen = []
    layer = Recording(lambda module: seen.append(module.weight))
    x = torch.randn(2, 3)
    expected = layer(x)
    stored = layer.weight.detach().clone()  # the weights map's tensor
    placed = nn.Parameter(stored.clone())  # the copy another module of the tie group already put on the device
    tied = {stored.data_ptr(): {"cpu": placed}}
    attach_align_device_hook(layer, "cpu", offload=True, weights_map={"weight": stored}, tied_params_map=tied)
    torch.testing.assert_close(layer(x), expected)
    assert seen[-1] is placed and tied[stored.data_ptr()] == {"cpu": placed}  # not this hook's to release


def test_an_offloaded_tied_weight_brought_in_by_a_hook_is_released_after_its_forward():
    seen, tied = [], {}
    layer = Recording(lambda module: seen.append((module.weight, {k: dict(v) for k, v in tied.items()})))
    x = torch.randn(2, 3)
    expected = layer(x)
    stored = layer.weight.detach().clone()
    tied[stored.data_ptr()] = {}
    attach_align_device_hook(layer, "cpu", offload=True, weights_map={"weight": stored}, tied_params_map=tied)
    seen.clear()
    torch.testing.assert_close(layer(x), expected)
    weight, during = seen[0]
    assert during[stored.data_ptr()] == {
        "cpu": weight
    }  # recorded for the other names of the group while the forward runs
    assert tied[stored.data_ptr()] == {}  # and released after it


def test_align_device_hook_repr():
    assert "offload=True" in repr(AlignDevicesHook(execution_device="cpu", offload=True))
