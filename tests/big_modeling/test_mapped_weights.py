"""CPU weights served zero-copy from a checkpoint stay what was loaded while the file is rewritten in place
(issue 12, defect 2): `cp` over it, truncation, a rewrite with identical bytes after an edit of a weight, torch.save
in the same process. The mapping is guarded by a read lease (accel.checkpoint.leased_mapping); where none can be
taken, weights are copied.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from accel.checkpoint import save_state_dict

SIZE = 512  # 1 MiB of weights per checkpoint


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(SIZE, SIZE, bias=False))


def save(folder, value):
    save_state_dict({"0.weight": torch.full((SIZE, SIZE), float(value))}, folder)
    return os.path.join(folder, "model.safetensors")


def load(folder):
    with init_empty_weights():
        model = make_model()
    return load_checkpoint_and_dispatch(model, folder, device_map={"": "cpu"})


def backing_file(tensor):
    """The file /proc/self/maps says the tensor's memory maps, or None for anonymous memory."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                path = fields[5].strip() if len(fields) > 5 else ""
                return path if path.startswith("/") else None
    return None


SERVER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {here!r})
    from test_mapped_weights import backing_file, load
    models = {{name: load(folder) for name, folder in json.loads(sys.argv[1]).items()}}
    weights = {{name: model[0].weight for name, model in models.items()}}
    mapped = {{name: backing_file(w) is not None for name, w in weights.items()}}
    with __import__("torch").no_grad():
        weights["same_bytes"][0, 0] += 100.0  # this process's own edit (copy-on-write)
    print("ready", json.dumps(mapped), flush=True)
    sys.stdin.readline()  # the writers run now
    print(json.dumps({{name: [w.sum().item(), w[0, 0].item(), w[-1, -1].item()] for name, w in weights.items()}}))
    """
)


def test_weights_survive_in_place_writers_of_their_file(tmp_path):
    folders = {name: str(tmp_path / name) for name in ("cp", "truncated", "same_bytes")}
    served = {name: save(folder, 1.0) for name, folder in folders.items()}
    other, same = save(str(tmp_path / "other"), 2.0), save(str(tmp_path / "same"), 1.0)
    script = SERVER.format(here=os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(folders)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = server.stdout.readline().split(maxsplit=1)
        assert first[:1] == ["ready"], server.stderr.read()
        assert json.loads(first[1]) == dict.fromkeys(folders, True)  # zero-copy: the file's pages
        subprocess.run(["cp", other, served["cp"]], check=True, timeout=60)  # in place: open(O_TRUNC) + write
        os.truncate(served["truncated"], 0)
        subprocess.run(["cp", same, served["same_bytes"]], check=True, timeout=60)
        out, err = server.communicate("go\n", timeout=120)
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 0, f"the serving process died (SIGBUS is -7): {err}"
    result = json.loads(out.strip().splitlines()[-1])
    n = SIZE * SIZE
    assert result["cp"] == [n * 1.0, 1.0, 1.0]  # not the new file's 2.0
    assert result["truncated"] == [n * 1.0, 1.0, 1.0]
    assert result["same_bytes"] == [n * 1.0 + 100.0, 101.0, 1.0]  # the edit is kept


def test_a_file_open_for_writing_is_copied_not_mapped(tmp_path):
    path = save(str(tmp_path / "ckpt"), 3.0)
    with open(path, "r+b"):  # a writer holds it open: no lease, so no mapping
        model = load(str(tmp_path / "ckpt"))
    assert backing_file(model[0].weight) is None
    assert torch.all(model[0].weight == 3.0)


def test_mapping_can_be_turned_off(tmp_path, monkeypatch):
    save(str(tmp_path / "ckpt"), 4.0)
    assert backing_file(load(str(tmp_path / "ckpt"))[0].weight) is not None
    monkeypatch.setenv("ACCEL_MAP_CHECKPOINTS", "0")
    model = load(str(tmp_path / "ckpt"))
    assert backing_file(model[0].weight) is None
    assert torch.all(model[0].weight == 4.0)


def test_a_writer_in_this_process_gets_the_copy_first_and_the_file_is_written(tmp_path):
    path = save(str(tmp_path / "ckpt"), 5.0)
    model = load(str(tmp_path / "ckpt"))
    with open(path, "r+b") as f:  # Python's open releases the GIL while the lease breaks
        f.seek(-4, os.SEEK_END)
        f.write(torch.tensor([9.0]).numpy().tobytes())
    assert backing_file(model[0].weight) is None  # now private memory
    assert torch.all(model[0].weight == 5.0)
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        assert f.read() == torch.tensor([9.0]).numpy().tobytes()


def test_weights_of_a_dropped_model_release_their_lease(tmp_path):
    path = save(str(tmp_path / "ckpt"), 6.0)
    model = load(str(tmp_path / "ckpt"))
    del model
    import gc

    gc.collect()
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # a lease still held would refuse this (EWOULDBLOCK)
    os.close(fd)


def test_loading_twice_maps_twice_and_each_survives_a_writer(tmp_path):
    path = save(str(tmp_path / "ckpt"), 7.0)
    first, second = load(str(tmp_path / "ckpt")), load(str(tmp_path / "ckpt"))
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\0")
    assert torch.all(first[0].weight == 7.0) and torch.all(second[0].weight == 7.0)


@pytest.mark.native  # the Python fallback's watcher needs the GIL torch.save holds: it waits for the kernel (45 s)
@pytest.mark.timeout(60)
def test_torch_save_over_the_file_in_this_process_gets_the_copy_first(tmp_path):
    path = save(str(tmp_path / "ckpt"), 8.0)
    model = load(str(tmp_path / "ckpt"))
    assert backing_file(model[0].weight) is not None
    started = time.monotonic()
    torch.save({"other": torch.arange(3.0)}, path)  # its C++ writer opens the file while holding the GIL
    assert time.monotonic() - started < 10  # the lease-break time is 45 s
    assert backing_file(model[0].weight) is None  # now private memory
    assert torch.all(model[0].weight == 8.0)
    with open(path, "rb") as written:  # a file object: torch.load reads a *.safetensors path as safetensors
        assert torch.equal(torch.load(written)["other"], torch.arange(3.0))  # and the file was written
