"""accel.checkpointing (HF's `accelerate.checkpointing` functions): the same files as save_state, from lists of
objects."""

import os
import random

import pytest
import torch

from accel.accelerator import Accelerator
from accel.checkpointing import load_accelerator_state, load_custom_state, save_accelerator_state, save_custom_state


def training_objects(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
    return model, optimizer, scheduler, scaler


class Counter:
    def __init__(self, count=0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_round_trip_restores_every_object_and_the_random_states(tmp_path, safe_serialization):
    model, optimizer, scheduler, scaler = training_objects(1)
    random.seed(7)
    torch.manual_seed(7)
    folder = save_accelerator_state(
        tmp_path / "ckpt",
        [model.state_dict()],
        [optimizer],
        [scheduler],
        [],
        0,
        42,
        scaler=scaler,
        safe_serialization=safe_serialization,
    )
    expected_draws = (random.random(), torch.rand(3))
    model_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    assert sorted(os.listdir(folder)) == sorted(
        [model_name, "optimizer.bin", "scheduler.bin", "scaler.pt", "random_states_0.pkl"]
    )

    other, other_optimizer, other_scheduler, other_scaler = training_objects(2)
    overrides = load_accelerator_state(
        folder, [other], [other_optimizer], [other_scheduler], [], 0, scaler=other_scaler
    )
    assert overrides == {"step": 42}
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor)
    saved_momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(other_optimizer.state_dict()["state"][0]["momentum_buffer"], saved_momentum)
    assert other_scheduler.get_last_lr() == scheduler.get_last_lr() and other_scaler.get_scale() == 2.0
    assert (random.random(), torch.rand(3).tolist()) == (expected_draws[0], expected_draws[1].tolist())


def test_files_written_by_save_state_load_through_the_functions(tmp_path):
    accelerator = Accelerator()
    model, optimizer, scheduler, _ = training_objects(3)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.save_state(tmp_path / "ckpt")
    other, other_optimizer, other_scheduler, _ = training_objects(4)
    load_accelerator_state(
        tmp_path / "ckpt", [other], [other_optimizer], [other_scheduler], [], 0, map_location="on_device"
    )
    assert torch.equal(other.weight, accelerator.unwrap_model(model).weight)
    assert other_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_bad_arguments_are_named(tmp_path):
    model, optimizer, scheduler, _ = training_objects(5)
    save_accelerator_state(tmp_path, [model.state_dict()], [], [], [], 0, 0)
    with pytest.raises(TypeError, match="map location"):
        load_accelerator_state(tmp_path, [model], [], [], [], 0, map_location="gpu")
    with pytest.raises(TypeError, match="assign"):
        load_accelerator_state(tmp_path, [model], [], [], [], 0, assign=True)
    with pytest.raises(Exception, match="missing"):  # strict by default, as HF
        load_accelerator_state(tmp_path, [torch.nn.Sequential(torch.nn.Linear(3, 2))], [], [], [], 0)


def test_custom_state_round_trip_is_weights_only_by_default(tmp_path):
    save_custom_state(Counter(5), tmp_path, index=2)
    assert os.path.exists(tmp_path / "custom_checkpoint_2.pkl")
    restored = Counter()
    load_custom_state(restored, tmp_path, index=2)
    assert restored.count == 5
    save_custom_state(type("Holder", (), {"state_dict": lambda self: {"obj": Counter(1)}})(), tmp_path, index=3)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_custom_state(Counter(), tmp_path, index=3)
    holder = type("Holder", (), {"load_state_dict": lambda self, state: setattr(self, "state", state)})()
    load_custom_state(holder, tmp_path, index=3, load_kwargs={"weights_only": False})
    assert holder.state["obj"].count == 1
