"""A checkpoint replaced or rewritten while it is loaded (issue 12, defect 1): every loader reads the header and
the data of one file through one descriptor, or fails naming the change; never one file's header with another's
bytes.

The writer is simulated at the worst moment: right after a file's header was parsed (a patched `parse_header`),
the file is replaced by a complete new checkpoint (what an atomic rename by any writer does) or rewritten in place.
"""

import os

import pytest
import torch

from accel.accelerator import Accelerator
from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from accel.checkpoint import load_checkpoint_in_model, save_state_dict
from accel.checkpoint import safetensors_io as io
from accel.checkpoint.safetensors_io import CheckpointError
from accel.state import AcceleratorState, GradientState


def model(seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))


def write_other(path, meta_bytes=200):
    """A valid safetensors file at `path` (atomically, a new inode) with other values and a longer header, so that
    its data sits at other offsets: read with the old header, its JSON would come back as floats."""
    other = {name: torch.full_like(t, 7.0) for name, t in model(0).state_dict().items()}
    io.save_file(other, path, metadata={"format": "pt", "padding": "x" * meta_bytes})


def replace_after_header(monkeypatch, action):
    """Runs `action(path)` once, right after the first header is parsed."""
    original = io.parse_header
    done = []

    def parse_then_replace(path, raw, size):
        header = original(path, raw, size)
        if not done:
            done.append(path)
            action(path)
        return header

    monkeypatch.setattr(io, "parse_header", parse_then_replace)
    return done


def rewrite_in_place(path):
    with open(path, "r+b") as f:  # same inode, new bytes after the header
        f.seek(-64, os.SEEK_END)
        f.write(b"\x7f" * 64)


def consistent_with(loaded, saved):
    return all(torch.equal(loaded[name], saved[name]) for name in saved)


def test_load_checkpoint_and_dispatch_reads_the_file_it_validated(tmp_path, monkeypatch):
    saved = model(1).state_dict()
    save_state_dict(saved, tmp_path / "ckpt")
    replace_after_header(monkeypatch, write_other)
    with init_empty_weights():
        target = model()
    load_checkpoint_and_dispatch(target, tmp_path / "ckpt", device_map={"": "cpu"})
    assert consistent_with(target.state_dict(), saved)  # the file as validated, never the new one's bytes


def test_load_checkpoint_in_model_reads_the_file_it_validated(tmp_path, monkeypatch):
    saved = model(1).state_dict()
    save_state_dict(saved, tmp_path / "ckpt")
    replace_after_header(monkeypatch, write_other)
    target = model(5)
    load_checkpoint_in_model(target, tmp_path / "ckpt", strict=True)
    assert consistent_with(target.state_dict(), saved)


def test_load_state_reads_the_file_it_validated(tmp_path, monkeypatch):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator()
    prepared = accelerator.prepare(model(1))
    saved = {k: v.clone() for k, v in prepared.state_dict().items()}
    accelerator.save_state(tmp_path / "state")
    with torch.no_grad():
        for p in prepared.parameters():
            p.zero_()
    replace_after_header(monkeypatch, write_other)
    accelerator.load_state(tmp_path / "state")
    assert consistent_with(prepared.state_dict(), saved)


def test_a_header_read_earlier_refuses_a_replaced_file(tmp_path):
    path = tmp_path / "m.safetensors"
    io.save_file(model(1).state_dict(), path)
    header = io.read_header(path)
    write_other(path)
    with pytest.raises(CheckpointError, match="was replaced by another file"):
        io.read_into(header, {"0.weight": torch.empty(32, 64)})


@pytest.mark.parametrize("loader", ["dispatch", "in_model"])
def test_a_file_rewritten_in_place_while_loading_is_a_clear_error(tmp_path, monkeypatch, loader):
    """In place (same inode): what was read cannot be trusted, and the error says why."""
    save_state_dict(model(1).state_dict(), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    os.utime(path, ns=(0, 0))  # so that the rewrite surely moves the mtime

    def rewrite(p):
        rewrite_in_place(p)

    replace_after_header(monkeypatch, rewrite)
    with pytest.raises(CheckpointError, match="rewritten in place"):
        if loader == "dispatch":
            with init_empty_weights():
                target = model()
            load_checkpoint_and_dispatch(target, tmp_path / "ckpt", device_map={"": "cpu"})
        else:
            load_checkpoint_in_model(model(), tmp_path / "ckpt")
