"""The offload folder is safe to keep where others can write (issue 12, the offload folder's small defects):
temporary files get names nobody can plant in advance and are never written through a symbolic link; index.json
is replaced atomically."""

import json
import os

import pytest
import torch

from accel.big_modeling.offload import load_offloaded_weight, offload_weight, save_offload_index
from accel.checkpoint import atomic_files


def test_a_symlink_planted_at_the_old_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "offload"
    folder.mkdir()
    os.symlink(victim, folder / f"w.dat.tmp-{os.getpid()}")  # the name the offload folder used to write through
    index = offload_weight(torch.arange(4.0), "w", folder)
    assert victim.read_text() == "precious"
    assert torch.equal(load_offloaded_weight(folder / "w.dat", index["w"]), torch.arange(4.0))


def test_temporary_names_cannot_be_guessed():
    names = {atomic_files.temporary_name("/x/index.json") for _ in range(100)}
    assert len(names) == 100 and all(len(n.rsplit("-", 1)[1]) == 16 for n in names)  # 64 random bits each


def test_the_atomic_writer_refuses_a_planted_temporary_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = tmp_path / ".index.json.tmp-planted"
    os.symlink(victim, planted)
    monkeypatch.setattr(atomic_files, "temporary_name", lambda path: str(planted))
    with pytest.raises(FileExistsError):
        atomic_files.write_atomically(str(tmp_path / "index.json"), lambda f: f.write("{}"), mode="w")
    assert victim.read_text() == "precious" and os.path.islink(planted)


def test_index_json_is_replaced_atomically_and_merged(tmp_path, monkeypatch):
    save_offload_index({"a": {"dtype": "float32", "shape": [1]}}, tmp_path)
    inode = os.stat(tmp_path / "index.json").st_ino
    save_offload_index({"b": {"dtype": "float32", "shape": [2]}}, tmp_path)
    assert os.stat(tmp_path / "index.json").st_ino != inode  # a new file renamed in, never rewritten in place
    assert json.loads((tmp_path / "index.json").read_text()).keys() == {"a", "b"}
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []
