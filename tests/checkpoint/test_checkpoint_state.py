"""save_state / load_state: HF's layout, bit-identical resumption, numbered rotation, weights_only loading,
hooks, and crash safety under SIGKILL."""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from spawn_pool import run_on_ranks
from torch.utils.data import DataLoader, TensorDataset

from accel.accelerator import Accelerator
from accel.accelerator_config import DataLoaderConfiguration, GradScalerKwargs, ProjectConfiguration
from accel.checkpoint import CheckpointError
from accel.state import AcceleratorState, GradientState


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def fresh_accelerator(**kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def training_objects(accelerator, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(96, 8, generator=generator)
    dataset = TensorDataset(inputs, inputs.sum(-1, keepdim=True).sin())
    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def run_epochs(accelerator, model, optimizer, loader, scheduler, epochs):
    losses = []
    for _ in range(epochs):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


def params(accelerator, model):
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def _resume(folder, mixed_precision="no"):
    """(straight: 3 epochs) vs (1 epoch, save, new objects with another seed, load, 2 epochs): losses and params."""
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = fresh_accelerator(mixed_precision=mixed_precision, dataloader_config=config)
    objects = training_objects(accelerator)
    straight = run_epochs(accelerator, *objects, epochs=3)
    straight_params = params(accelerator, objects[0])

    accelerator = fresh_accelerator(mixed_precision=mixed_precision, dataloader_config=config)
    objects = training_objects(accelerator)
    first = run_epochs(accelerator, *objects, epochs=1)
    accelerator.save_state(os.path.join(folder, f"rank-agnostic-{mixed_precision}"))
    torch.manual_seed(1234)  # the RNG moves on before the restart; load_state must put it back
    random.random(), np.random.rand()

    accelerator = fresh_accelerator(mixed_precision=mixed_precision, dataloader_config=config)
    objects = training_objects(accelerator, seed=99)
    accelerator.load_state(os.path.join(folder, f"rank-agnostic-{mixed_precision}"))
    rest = run_epochs(accelerator, *objects, epochs=2)
    return straight, straight_params, first + rest, params(accelerator, objects[0])


@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
def test_resuming_continues_bit_identically(tmp_path, mixed_precision):
    straight, straight_params, resumed, resumed_params = _resume(str(tmp_path), mixed_precision)
    assert resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, straight_params))


def _resume_on_ranks(folder):
    straight, straight_params, resumed, resumed_params = _resume(folder)
    return resumed == straight and all(torch.equal(a, b) for a, b in zip(resumed_params, straight_params))


def test_resuming_continues_bit_identically_on_two_processes(tmp_path):
    assert run_on_ranks(_resume_on_ranks, 2, str(tmp_path), timeout=180) == [True, True]


def test_the_folder_has_hf_accelerates_layout(tmp_path):
    accelerator = fresh_accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=64.0)])
    training_objects(accelerator)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.register_for_checkpointing(Counter())
    folder = accelerator.save_state(str(tmp_path / "state"))
    accelerator.wait_for_checkpoint()
    assert sorted(os.listdir(folder)) == [
        ".accel-durability",  # accel's record (hidden): "unsynced", rewritten "durable" once fsync'd
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "model_1.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "sampler.bin",
        "scaler.pt",
        "scheduler.bin",
    ]
    assert sorted(os.listdir(tmp_path)) == ["state"]  # no partial folder left behind
    assert torch.load(os.path.join(folder, "scaler.pt"), weights_only=True)["scale"] == 64.0


def test_safe_serialization_false_writes_bin_files(tmp_path):
    accelerator = fresh_accelerator()
    model, *_ = training_objects(accelerator)
    folder = accelerator.save_state(str(tmp_path / "state"), safe_serialization=False)
    assert "pytorch_model.bin" in os.listdir(folder)
    before = params(accelerator, model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(folder)
    assert all(torch.equal(a, b) for a, b in zip(params(accelerator, model), before))


def test_automatic_naming_rotates_by_number_and_load_state_takes_the_latest(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=3)
    accelerator = fresh_accelerator(project_config=config)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    for i in range(12):  # checkpoint_10 and _11 sort before checkpoint_2 as strings
        counter.count = i
        accelerator.save_state()
    accelerator.wait_for_checkpoint()  # the newest durable checkpoint is kept until the new ones are durable
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root), key=lambda n: int(n.split("_")[1])) == [
        "checkpoint_9",
        "checkpoint_10",
        "checkpoint_11",
    ]
    accelerator = fresh_accelerator(
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=3)
    )
    restored = Counter()
    accelerator.register_for_checkpointing(restored)
    assert accelerator.load_state().endswith("checkpoint_11") and restored.count == 11
    assert accelerator.save_iteration == 12
    accelerator.save_state()  # continues the numbering instead of failing on an existing folder
    assert "checkpoint_12" in os.listdir(root)


class Opaque:
    pass


class HoldsAnObject(Counter):
    def state_dict(self):
        return {"count": self.count, "thing": Opaque()}


def test_loading_never_unpickles_arbitrary_objects_by_default(tmp_path):
    accelerator = fresh_accelerator()
    accelerator.register_for_checkpointing(HoldsAnObject())
    folder = accelerator.save_state(str(tmp_path / "state"))
    with pytest.raises(Exception, match="Weights only load failed"):
        accelerator.load_state(folder)
    accelerator.load_state(folder, load_kwargs={"weights_only": False})  # the user vouches for the file


def test_pre_hooks_save_and_load_models_themselves_as_diffusers_does(tmp_path):
    """HF's hook pattern: the save hook writes a model its own way and pops its weights; the load hook pops the
    model it loads. The hook's files land in the published checkpoint; the Accelerator keeps its models."""
    accelerator = fresh_accelerator()
    model, *_ = training_objects(accelerator)
    calls = []

    def save_hook(models, weights, folder):
        calls.append(("save", len(models)))
        torch.save(accelerator.unwrap_model(models[0]).state_dict(), os.path.join(folder, "my_model.pt"))
        weights.pop()

    def load_hook(models, folder):
        calls.append(("load", len(models)))
        accelerator.unwrap_model(models.pop()).load_state_dict(torch.load(os.path.join(folder, "my_model.pt")))

    save_handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    folder = accelerator.save_state(str(tmp_path / "a"))
    assert "my_model.pt" in os.listdir(folder) and "model.safetensors" not in os.listdir(folder)
    accelerator.load_state(folder)
    assert len(accelerator._models) == 1  # the hook popped from a copy
    save_handle.remove()
    accelerator.save_state(str(tmp_path / "b"))
    assert calls == [("save", 1), ("load", 1)]


def test_rotation_never_removes_the_checkpoint_just_written(tmp_path):
    """An earlier run left checkpoint_7..9 in the same project; a new run starts numbering at 0."""
    for number in (7, 8, 9):
        (tmp_path / "checkpoints" / f"checkpoint_{number}").mkdir(parents=True)
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = fresh_accelerator(project_config=config)
    accelerator.save_state()
    visible = sorted(n for n in os.listdir(tmp_path / "checkpoints") if not n.startswith("."))  # discarded: hidden
    assert visible == ["checkpoint_0", "checkpoint_9"]


def test_saving_into_a_folder_with_other_content_keeps_it(tmp_path):
    accelerator = fresh_accelerator()
    training_objects(accelerator)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.txt").write_text("keep me")
    accelerator.save_state(str(tmp_path))
    accelerator.save_state(str(tmp_path))
    assert (tmp_path / "logs" / "events.txt").read_text() == "keep me"
    assert "model.safetensors" in os.listdir(tmp_path)


def test_loading_an_incomplete_folder_changes_nothing(tmp_path):
    accelerator = fresh_accelerator()
    model, *_ = training_objects(accelerator)
    folder = accelerator.save_state(str(tmp_path / "state"))
    os.remove(os.path.join(folder, "optimizer.bin"))
    before = params(accelerator, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    changed = params(accelerator, model)
    with pytest.raises(FileNotFoundError, match="missing optimizer.bin"):
        accelerator.load_state(folder)
    assert all(torch.equal(a, b) for a, b in zip(params(accelerator, model), changed))
    assert not all(torch.equal(a, b) for a, b in zip(changed, before))


def _fail_on_rank_one(folder):
    accelerator = fresh_accelerator()
    training_objects(accelerator)

    def hook(models, weights, out):
        if accelerator.process_index == 1:
            raise OSError(28, "No space left on device")

    accelerator.register_save_state_pre_hook(hook)
    try:
        accelerator.save_state(folder)
    except (OSError, RuntimeError) as error:
        return type(error).__name__, str(error)
    return "saved", ""


def test_a_failure_on_one_process_raises_on_every_process_and_publishes_nothing(tmp_path):
    folder = str(tmp_path / "state")
    (kind_0, message_0), (kind_1, _) = run_on_ranks(_fail_on_rank_one, 2, folder, timeout=120)
    assert kind_1 == "OSError" and kind_0 == "RuntimeError" and "another process" in message_0
    assert os.listdir(tmp_path) == []  # neither the checkpoint nor its staging folder


def test_register_for_checkpointing_refuses_objects_without_state_dict():
    with pytest.raises(ValueError, match="1: int"):
        fresh_accelerator().register_for_checkpointing(Counter(), 3)


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    accelerator = fresh_accelerator()
    accelerator.prepare(torch.nn.Linear(3, 4))
    folder = accelerator.save_state(str(tmp_path / "state"))
    accelerator = fresh_accelerator()
    accelerator.prepare(torch.nn.Linear(3, 5))
    with pytest.raises(CheckpointError, match=r"tensor 'weight': the checkpoint has shape \[4, 3\]"):
        accelerator.load_state(folder)


def _save_under_ddp(folder):
    accelerator = fresh_accelerator()
    model, *_ = training_objects(accelerator)
    hooked = []
    accelerator.register_save_state_pre_hook(lambda models, weights, out: hooked.extend(map(type, models)))
    accelerator.save_state(folder)
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return weights, type(model).__name__, [cls.__name__ for cls in hooked]


@pytest.fixture
def hf_accelerate():
    """HF Accelerate 1.15 itself, in this process (one process, CPU); its singletons are reset afterwards."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState as HFAcceleratorState
    from accelerate.state import GradientState as HFGradientState

    try:
        yield accelerate
    finally:
        HFAcceleratorState._reset_state(True)
        HFGradientState._reset_state()


def hf_training_objects(hf_accelerator, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    return hf_accelerator.prepare(model, optimizer, scheduler)


def test_a_checkpoint_saved_under_ddp_has_hf_names_and_hf_accelerate_resumes_from_it(tmp_path, hf_accelerate):
    """HF Accelerate saves the model given to prepare (its `_models`), not the DDP wrapper, and loads strictly
    into it: the names have no "module.", and HF's own load_state takes them in one process. Save hooks get the
    model as given, as in HF."""
    folder = str(tmp_path / "state")
    (saved, wrapper, hooked), _ = run_on_ranks(_save_under_ddp, 2, folder)
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    hf_accelerator = hf_accelerate.Accelerator(cpu=True)
    model, *_ = hf_training_objects(hf_accelerator, seed=7)
    hf_accelerator.load_state(folder)  # strict: safetensors' load_model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))
    assert wrapper == "DistributedDataParallel" and hooked == ["Sequential"]


def test_checkpoints_with_wrapper_prefixes_and_hf_accelerates_own_load(tmp_path, hf_accelerate):
    """accel still loads a checkpoint whose names carry DDP's "module." (older accel saves), and one that HF
    Accelerate's save_state wrote."""
    from safetensors.torch import load_file, save_file

    accelerator = fresh_accelerator()
    model, *_ = training_objects(accelerator)
    folder = accelerator.save_state(str(tmp_path / "prefixed"))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    save_file({f"module.{name}": tensor for name, tensor in weights.items()}, os.path.join(folder, "model.safetensors"))
    accelerator = fresh_accelerator()
    other, *_ = training_objects(accelerator, seed=7)
    accelerator.load_state(folder)
    assert all(torch.equal(a, weights[n]) for n, a in accelerator.unwrap_model(other).state_dict().items())

    hf_accelerator = hf_accelerate.Accelerator(cpu=True)
    hf_model, *_ = hf_training_objects(hf_accelerator, seed=3)
    with pytest.raises(RuntimeError, match='Unexpected key.*"module.0.bias"'):  # why HF cannot resume from those
        hf_accelerator.load_state(folder)
    hf_accelerator.save_state(str(tmp_path / "hf"))
    accelerator = fresh_accelerator()
    model, *_ = training_objects(accelerator, seed=7)
    accelerator.load_state(str(tmp_path / "hf"))
    assert all(torch.equal(a, b) for a, b in zip(params(accelerator, model), hf_model.parameters()))


def test_a_compiled_models_checkpoint_has_the_names_of_the_model_given(tmp_path):
    """torch.compile's wrapper adds "_orig_mod." to the names; HF saves the model given to prepare, without it."""
    from safetensors import safe_open

    from accel.accelerator_config import TorchDynamoPlugin

    accelerator = fresh_accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    compiled = accelerator.prepare(torch.nn.Linear(3, 4))
    assert hasattr(compiled, "_orig_mod")
    folder = accelerator.save_state(str(tmp_path / "state"))
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"weight", "bias"}


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from accel.accelerator import Accelerator
    from accel.accelerator_config import ProjectConfiguration
    project, mode = sys.argv[1], sys.argv[2]
    automatic = mode == "automatic"
    configuration = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=automatic)
    accelerator = Accelerator(project_config=configuration)
    model = accelerator.prepare(torch.nn.Linear(1024, 2048))  # 8 MiB of weights: a save takes a while
    optimizer = accelerator.prepare(torch.optim.Adam(model.parameters()))
    iteration = 0
    while True:
        with torch.no_grad():
            model.weight.fill_(iteration)
        accelerator.save_state(None if automatic else os.path.join(project, "fixed"))
        iteration += 1
        if iteration == 1:
            print("ready", flush=True)
    """
)


@pytest.mark.parametrize("mode", ["automatic", "fixed"])
def test_a_process_killed_mid_save_always_leaves_a_loadable_checkpoint(tmp_path, mode):
    script = tmp_path / "saver.py"
    script.write_text(CRASH_SCRIPT)
    generator = random.Random(0)
    for run in range(10):
        project = tmp_path / f"run{run}"
        project.mkdir()
        child = subprocess.Popen([sys.executable, str(script), str(project), mode], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(generator.uniform(0.0, 0.6))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        _check_loadable(project, mode)


def _check_loadable(project, mode):
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=mode == "automatic")
    accelerator = fresh_accelerator(project_config=config)
    model = accelerator.prepare(torch.nn.Linear(1024, 2048))
    accelerator.prepare(torch.optim.Adam(model.parameters()))
    folder = accelerator.load_state(None if mode == "automatic" else str(project / "fixed"))
    value = model.weight[0, 0].item()
    assert torch.all(model.weight == value)  # one consistent save, never a mix
    if mode == "automatic":
        assert value == int(os.path.basename(folder).split("_")[1])


def test_a_publish_interrupted_between_its_renames_is_loaded_where_it_is_parked(tmp_path, monkeypatch):
    """Without renameat2 (NFS, CIFS, FUSE), publish parks the old folder at `<staging>.old` (also under
    save_on_each_node); a crash before the second rename must not hide the checkpoint (issue 12, defect 6), and
    the load reads it where it is parked, renaming nothing (issue 19, defect 1): the next save puts it back."""
    from accel.checkpoint import publish

    folder = str(tmp_path / "ckpt")
    accelerator = fresh_accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    model, *_ = training_objects(accelerator)
    accelerator.save_state(folder)
    saved = params(accelerator, model)
    monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    renames = []

    def crash_on_second_rename(source, target):
        renames.append((source, target))
        if len(renames) == 2:
            raise KeyboardInterrupt("simulated crash between the two renames")
        os.replace(source, target)

    monkeypatch.setattr(publish.os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        accelerator.save_state(folder)
    monkeypatch.undo()
    parked = os.path.basename(renames[0][1])
    assert not os.path.exists(folder) and re.fullmatch(r"\.ckpt\.partial-\d+-[0-9a-f]{16}\.old", parked)
    with torch.no_grad():
        for p in accelerator.unwrap_model(model).parameters():
            p.zero_()
    listing = sorted(os.listdir(tmp_path))
    accelerator.load_state(folder)
    assert all(torch.equal(a, b) for a, b in zip(params(accelerator, model), saved))
    assert sorted(os.listdir(tmp_path)) == listing  # the load renamed nothing
    accelerator.save_state(folder)  # the writer puts the parked checkpoint back before staging its own
    assert os.path.isdir(folder) and not any(name.endswith(".old") for name in os.listdir(tmp_path))


def test_publishing_into_a_folder_with_other_content_makes_that_folder_durable(tmp_path, monkeypatch):
    from accel.checkpoint import publish, publish_journal

    final, partial = tmp_path / "out", tmp_path / ".out.partial"
    final.mkdir()
    (final / "train.log").write_text("kept")
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"new")
    synced = []
    monkeypatch.setattr(publish, "fsync_directory", lambda path: synced.append(os.path.normpath(path)))
    monkeypatch.setattr(publish_journal, "fsync_directory", lambda path: synced.append(os.path.normpath(path)))
    publish.publish(str(partial), str(final))
    assert (final / "model.safetensors").read_bytes() == b"new" and (final / "train.log").read_text() == "kept"
    assert str(final) in synced  # the renames into it are durable, not only its parent's entry
