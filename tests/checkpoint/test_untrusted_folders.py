"""A model folder is data, not instructions (issue 19, defects 1 and 10).

Loading never writes, renames or deletes anything: a folder holding the journal of an interrupted `save_model`
is read through it (the new checkpoint, wherever its files are now), and the writer's next save completes it. A
journal naming anything but the plain entries of its own folder that accel writes is refused, by a load and by a
save, and left alone; a replay removes only files the journal proves are its own. An index naming a shard outside
its folder is refused, naming the entry.

Interrupted publishes are made by a real save interrupted at a chosen step; hostile journals by editing the names
in such a journal (so the tests do not depend on its format).
"""

import json
import os
import pickle
import re
import warnings

import pytest
import torch

from accel.big_modeling import load_checkpoint_and_dispatch
from accel.checkpoint import (
    CheckpointError,
    load_checkpoint_in_model,
    model_io,
    publish_journal,
    save_file,
    save_state_dict,
)
from accel.checkpoint.names import PUBLISH_JOURNAL, SAFE_WEIGHTS_INDEX_NAME

SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])


def weights(value: float) -> dict[str, torch.Tensor]:
    return {f"{i}.weight": torch.full((64, 64), value) for i in range(4)}


def loaded_value(loader, folder) -> float:
    target = model()
    loader(target, folder)
    values = {p.detach()[0, 0].item() for p in target.parameters()}
    assert len(values) == 1 and all(torch.all(p == p[0, 0]) for p in target.parameters())  # never a mix
    return values.pop()


def load_in_model(target, folder):
    load_checkpoint_in_model(target, folder, strict=True)


def dispatch(target, folder):
    load_checkpoint_and_dispatch(target, folder, strict=True)


LOADERS = {"load_checkpoint_in_model": load_in_model, "load_checkpoint_and_dispatch": dispatch}


def everything_under(root) -> dict:
    """Every entry under `root` with its kind, identity and content: what 'nothing changed' compares."""
    seen = {}
    for parent, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(parent, name)
            info = os.lstat(path)
            if os.path.islink(path):
                content = os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    content = f.read()
            else:
                content = None
            seen[os.path.relpath(path, root)] = (info.st_mode, info.st_ino, info.st_size, info.st_mtime_ns, content)
    return seen


def temporaries(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".tmp-" in name)


# --- interrupted publishes ------------------------------------------------------------------------------------------


def killed_after_the_first_swap(folder, monkeypatch):
    """The old sharded checkpoint (1.0) replaced by a new one of the same layout (2.0), killed after its first
    swap: shard 1 is new at its name (the old one at its temporary name); shard 2 and the index are still at theirs."""
    save_state_dict(weights(1.0), folder, max_shard_size="40KB")
    real_exchange, calls = publish_journal.exchange, []

    def exchange(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_exchange(a, b)

    with monkeypatch.context() as patched:
        patched.setattr(publish_journal, "exchange", exchange)
        with pytest.raises(KeyboardInterrupt):
            save_state_dict(weights(2.0), folder, max_shard_size="40KB")


def killed_before_the_old_index_went(folder, monkeypatch):
    """The old sharded checkpoint (1.0) replaced by one file (2.0), killed after its rename, before the old index
    was removed: the folder holds the new file beside the whole old checkpoint, index included."""
    save_state_dict(weights(1.0), folder, max_shard_size="40KB")

    def killed(paths):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(publish_journal, "remove_now_free_later", killed)
        with pytest.raises(KeyboardInterrupt):
            save_state_dict(weights(2.0), folder)
    assert os.path.exists(os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME))


INTERRUPTIONS = {
    "after the first swap": killed_after_the_first_swap,
    "before the old index went": killed_before_the_old_index_went,
}


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("interruption", list(INTERRUPTIONS))
def test_a_load_reads_an_interrupted_publish_as_the_new_checkpoint_and_changes_nothing(
    tmp_path, monkeypatch, interruption, loader
):
    folder = str(tmp_path / "out")
    INTERRUPTIONS[interruption](folder, monkeypatch)
    assert os.path.exists(os.path.join(folder, PUBLISH_JOURNAL))
    before = everything_under(tmp_path)
    assert loaded_value(LOADERS[loader], folder) == 2.0
    assert everything_under(tmp_path) == before


@pytest.mark.parametrize("interruption", list(INTERRUPTIONS))
def test_the_writer_completes_an_interrupted_publish(tmp_path, monkeypatch, interruption):
    folder = str(tmp_path / "out")
    INTERRUPTIONS[interruption](folder, monkeypatch)
    model_io.replay_journal(folder)  # what the next save into the folder does first
    assert not os.path.exists(os.path.join(folder, PUBLISH_JOURNAL)) and temporaries(folder) == []
    if interruption == "before the old index went":
        assert os.listdir(folder) == ["model.safetensors"]
    assert loaded_value(load_in_model, folder) == 2.0
    save_state_dict(weights(3.0), folder, max_shard_size="40KB")
    assert loaded_value(load_in_model, folder) == 3.0


# --- hostile journals -----------------------------------------------------------------------------------------------


def edit_journal(folder, old: str, new: str) -> None:
    """Replaces the name `old` (a whole JSON string) in the journal by `new`."""
    path = os.path.join(folder, PUBLISH_JOURNAL)
    with open(path) as f:
        text = f.read()
    assert json.dumps(old) in text
    with open(path, "w") as f:
        f.write(text.replace(json.dumps(old), json.dumps(new)))


def victims(tmp_path) -> tuple[str, str]:
    """A file beside the model folder and one elsewhere, named by absolute path."""
    (tmp_path / "elsewhere").mkdir()
    for path in (tmp_path / "victim.txt", tmp_path / "elsewhere" / "victim.txt"):
        path.write_text("not yours")
    return "../victim.txt", str(tmp_path / "elsewhere" / "victim.txt")


def remove_entries_outside(tmp_path, folder, monkeypatch) -> str:
    relative, absolute = victims(tmp_path)
    killed_before_the_old_index_went(folder, monkeypatch)
    edit_journal(folder, SHARD_1, relative)
    edit_journal(folder, SHARD_2, absolute)
    return relative


def the_issues_journal(tmp_path, folder, monkeypatch) -> str:
    relative, absolute = victims(tmp_path)
    save_state_dict(weights(2.0), folder)
    with open(os.path.join(folder, PUBLISH_JOURNAL), "w") as f:
        json.dump({"rename": [[relative, "model.safetensors", 1]], "remove": [relative, absolute]}, f)
    return relative


def a_temporary_outside(tmp_path, folder, monkeypatch) -> str:
    relative, _ = victims(tmp_path)
    killed_after_the_first_swap(folder, monkeypatch)
    edit_journal(folder, next(n for n in temporaries(folder) if SHARD_2 in n), relative)
    return relative


def a_name_outside(tmp_path, folder, monkeypatch) -> str:
    relative, _ = victims(tmp_path)
    killed_after_the_first_swap(folder, monkeypatch)
    edit_journal(folder, SHARD_2, relative)
    return relative


def a_temporary_accel_does_not_write(tmp_path, folder, monkeypatch) -> str:
    killed_after_the_first_swap(folder, monkeypatch)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("the user's")
    edit_journal(folder, next(n for n in temporaries(folder) if SHARD_2 in n), "notes.txt")
    return "notes.txt"


def a_temporary_that_is_a_symlink(tmp_path, folder, monkeypatch) -> str:
    victims(tmp_path)
    killed_after_the_first_swap(folder, monkeypatch)
    temporary = next(n for n in temporaries(folder) if SHARD_2 in n)
    os.unlink(os.path.join(folder, temporary))
    os.symlink(str(tmp_path / "victim.txt"), os.path.join(folder, temporary))
    return temporary


def an_entry_named_twice(tmp_path, folder, monkeypatch) -> str:
    """One rename twice over (a journal could otherwise make many guesses at one entry's identity)."""
    killed_after_the_first_swap(folder, monkeypatch)
    path = os.path.join(folder, PUBLISH_JOURNAL)
    with open(path) as f:
        plan = json.load(f)
    plan["rename"].append(plan["rename"][-1])
    with open(path, "w") as f:
        json.dump(plan, f)
    return plan["rename"][-1]["temporary"]


HOSTILE = {
    "the issue's": the_issues_journal,
    "remove entries outside": remove_entries_outside,
    "a temporary outside": a_temporary_outside,
    "a name outside": a_name_outside,
    "a temporary accel does not write": a_temporary_accel_does_not_write,
    "a temporary that is a symlink": a_temporary_that_is_a_symlink,
    "an entry named twice": an_entry_named_twice,
}


def save(target, folder):
    save_state_dict(weights(3.0), folder, max_shard_size="40KB")


@pytest.mark.parametrize("actor", ["load_checkpoint_in_model", "load_checkpoint_and_dispatch", "save"])
@pytest.mark.parametrize("journal", list(HOSTILE))
def test_a_journal_naming_anything_but_its_own_entries_is_refused_and_changes_nothing(
    tmp_path, monkeypatch, journal, actor
):
    folder = str(tmp_path / "out")
    bad_entry = HOSTILE[journal](tmp_path, folder, monkeypatch)
    before = everything_under(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        (save if actor == "save" else LOADERS[actor])(model(), folder)
    assert os.path.join(folder, PUBLISH_JOURNAL) in str(refused.value) and bad_entry in str(refused.value)
    assert everything_under(tmp_path) == before


def test_a_replay_leaves_a_file_the_journal_cannot_prove_is_its_own(tmp_path, monkeypatch):
    """A file at a journaled temporary name that is neither the new file nor the one it replaced: a load cannot
    read the new checkpoint (and says so), and the writer's replay leaves that file where it is."""
    folder = str(tmp_path / "out")
    killed_after_the_first_swap(folder, monkeypatch)
    temporary = os.path.join(folder, next(n for n in temporaries(folder) if SHARD_2 in n))
    other = tmp_path / "other"
    other.write_bytes(b"someone else's")
    os.replace(other, temporary)
    before = everything_under(tmp_path)
    with pytest.raises(CheckpointError, match="interrupted"):
        load_in_model(model(), folder)
    assert everything_under(tmp_path) == before
    model_io.replay_journal(folder)
    with open(temporary, "rb") as f:
        assert f.read() == b"someone else's"


# --- indexes --------------------------------------------------------------------------------------------------------


def index_naming(tmp_path, shard: str) -> str:
    """A model folder whose index names `shard` for its second half; both shards exist and are valid."""
    folder = tmp_path / "model"
    (tmp_path / "elsewhere").mkdir()
    (folder / "sub").mkdir(parents=True)  # so that `sub/../..` leads out of it
    tensors = weights(2.0)
    save_file({n: tensors[n] for n in ("0.weight", "1.weight")}, folder / SHARD_1)
    outside = tmp_path / "elsewhere" / SHARD_2
    save_file({n: tensors[n] for n in ("2.weight", "3.weight")}, outside)
    named = str(outside) if shard == "absolute" else shard
    weight_map = {"0.weight": SHARD_1, "1.weight": SHARD_1, "2.weight": named, "3.weight": named}
    (folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return named


@pytest.mark.parametrize("given", ["folder", "index"])
@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("shard", [f"../elsewhere/{SHARD_2}", f"sub/../../elsewhere/{SHARD_2}", "absolute"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, shard, loader, given):
    named = index_naming(tmp_path, shard)
    index = str(tmp_path / "model" / SAFE_WEIGHTS_INDEX_NAME)
    with pytest.raises(CheckpointError) as refused:
        LOADERS[loader](model(), index if given == "index" else str(tmp_path / "model"))
    assert index in str(refused.value) and "'2.weight'" in str(refused.value) and named in str(refused.value)


@pytest.mark.parametrize(
    "weight_map,message",
    [
        ([SHARD_1], "weight_map must map tensor names to file names"),
        ({"0.weight": 1}, "weight_map must map tensor names to file names"),
        ({"0.weight": ""}, "weight_map entry '0.weight' names ''"),
        ({"0.weight": "x\0.safetensors"}, "weight_map entry '0.weight' names 'x\\x00.safetensors'"),
    ],
)
def test_an_index_with_a_malformed_weight_map_names_the_problem(tmp_path, weight_map, message):
    index = tmp_path / SAFE_WEIGHTS_INDEX_NAME
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=re.escape(message)) as refused:
        load_in_model(model(), str(tmp_path))
    assert str(index) in str(refused.value)


def test_an_index_in_the_hub_cache_layout_loads(tmp_path):
    """The Hub cache's snapshot folders hold symbolic links to `../../blobs/...`: shards behind them load, as do
    shards in a subfolder of the index's."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    (snapshot / "sub").mkdir(parents=True)
    tensors = weights(2.0)
    save_file({n: tensors[n] for n in ("0.weight", "1.weight")}, blobs / "1")
    save_file({n: tensors[n] for n in ("2.weight", "3.weight")}, snapshot / "sub" / SHARD_2)
    weight_map = {"0.weight": SHARD_1, "1.weight": SHARD_1, "2.weight": f"sub/{SHARD_2}", "3.weight": f"sub/{SHARD_2}"}
    (blobs / "index").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.symlink("../../blobs/1", snapshot / SHARD_1)
    os.symlink("../../blobs/index", snapshot / SAFE_WEIGHTS_INDEX_NAME)
    for loader in LOADERS.values():
        assert loaded_value(loader, str(snapshot)) == 2.0


# --- DCP folders (FSDP's sharded checkpoints) ----------------------------------------------------------------------


class _RunsOnLoad:
    """Unpickles into a call of open(marker, "w"): what a crafted `.metadata` would do under plain pickle.load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "pytorch_model_fsdp_0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, a single process
        dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return folder


def _load_dcp(folder):
    import torch.distributed.checkpoint as dcp

    from accel.checkpoint.sharded import checked_reader

    state = {"w": torch.zeros(6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=checked_reader(str(folder)), no_dist=True)
    return state["w"]


def test_a_dcp_folder_loads_through_the_checked_reader(tmp_path):
    assert torch.equal(_load_dcp(_dcp_folder(tmp_path)), torch.arange(6.0))


def test_a_dcp_metadata_that_names_a_callable_is_refused_and_runs_nothing(tmp_path):
    folder = _dcp_folder(tmp_path)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsOnLoad(str(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata: DCP metadata names (builtins|io)\.open"):
        _load_dcp(folder)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../elsewhere.distcp", "/tmp/abs.distcp", ".."])
def test_a_dcp_metadata_naming_a_shard_outside_its_folder_is_refused(tmp_path, name):
    folder = _dcp_folder(tmp_path)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = name
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file of its folder"):
        _load_dcp(folder)


def test_a_replay_never_puts_a_new_file_over_one_the_journal_did_not_see(tmp_path, monkeypatch):
    """After the kill, the user put another file at a name the journal still has to publish: the writer's replay
    refuses, moving nothing more, and the user's file stays."""
    folder = str(tmp_path / "out")
    killed_after_the_first_swap(folder, monkeypatch)
    with open(os.path.join(folder, SHARD_2), "wb") as f:
        f.write(b"the user's")
    before = everything_under(tmp_path)
    with pytest.raises(CheckpointError, match="no longer the entry it recorded"):
        model_io.replay_journal(folder)
    assert everything_under(tmp_path) == before
