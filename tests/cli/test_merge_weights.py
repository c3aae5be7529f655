"""`accel merge-weights` / `merge_fsdp_weights`: a torch.distributed.checkpoint folder merged into one file."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawn_pool import run_on_ranks

from accel.checkpoint import load_file
from accel.checkpoint.dcp_merge import MergeError, load_dcp_state_dict, merge_fsdp_weights
from accel.cli.main import main
from accel.commands.merge import merge_command, merge_command_parser

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")


def full_weights():
    generator = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(6, 4, generator=generator),
        "fc1.bias": torch.randn(6, generator=generator),
        "fc2.weight": torch.randn(3, 6, generator=generator).to(torch.bfloat16),
    }


def _save_sharded(path):
    """On each rank: every weight as a DTensor sharded on dim 0 (what FSDP's SHARDED_STATE_DICT saves)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from accel.state import PartialState

    state = PartialState()
    mesh = init_device_mesh("cpu", (state.num_processes,))
    sharded = {name: distribute_tensor(tensor, mesh, [Shard(0)]) for name, tensor in full_weights().items()}
    dcp.save({"model": sharded}, checkpoint_id=path)
    return {name: tuple(tensor.to_local().shape) for name, tensor in sharded.items()}


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp") / "pytorch_model_fsdp_0"
    local_shapes = run_on_ranks(_save_sharded, 2, str(path))
    assert local_shapes[0]["fc1.weight"] == (3, 4)  # really sharded: each rank saved half
    return path


def assert_same(merged, expected):
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name


def test_a_sharded_checkpoint_merges_into_safetensors(sharded_checkpoint, tmp_path):
    merge_fsdp_weights(str(sharded_checkpoint), str(tmp_path / "out"))
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), full_weights())
    assert sharded_checkpoint.exists()


def test_the_command_writes_pytorch_model_bin_when_asked(sharded_checkpoint, tmp_path):
    assert main(["merge-weights", str(sharded_checkpoint), str(tmp_path), "--unsafe_serialization"]) == 0
    assert_same(torch.load(tmp_path / "pytorch_model.bin", weights_only=True), full_weights())
    assert not (tmp_path / "model.safetensors").exists()


def test_hf_module_path_and_remove_checkpoint_dir(tmp_path):
    folder = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": full_weights()}, checkpoint_id=folder, no_dist=True)
    args = merge_command_parser().parse_args([str(folder), str(tmp_path / "merged"), "--remove_checkpoint_dir"])
    merge_command(args)
    assert_same(load_file(tmp_path / "merged" / "model.safetensors"), full_weights())
    assert not folder.exists()


def test_non_tensor_entries_need_unsafe_serialization(tmp_path):
    folder = tmp_path / "optimizer_0"
    dcp.save({"state": {"step": torch.tensor(3.0)}, "param_groups": [{"lr": 0.1}]}, checkpoint_id=folder, no_dist=True)
    with pytest.raises(MergeError, match="not tensors .*param_groups.*--unsafe_serialization"):
        merge_fsdp_weights(str(folder), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing written
    loaded = load_dcp_state_dict(folder, with_objects=True)
    assert loaded["param_groups"] == [{"lr": 0.1}] and loaded["state"]["step"] == 3.0


def test_a_parent_folder_points_to_the_checkpoint_inside(tmp_path, capsys):
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    assert main(["merge-weights", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "accel merge-weights: error: Tried to load from" in err and str(tmp_path / "pytorch_model_fsdp_0") in err
