"""Stateful prepared dataloaders (torchdata's StatefulDataLoader): resuming mid-epoch, sharded and dispatched, by
`state_dict()` / `load_state_dict()` and through `save_state` / `load_state` (`dl_state_dict*.bin`)."""

import os

import pytest
import torch
from data_fixtures import Stream
from spawn_pool import run_on_ranks
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DataLoaderConfiguration
from accel.checkpointing import load_accelerator_state, save_accelerator_state

pytest.importorskip("torchdata.stateful_dataloader")

STATEFUL = dict(use_stateful_dataloader=True)


def _values(batch):
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


def _run(loader, save_at=None, save=None):
    """The batches of one epoch; `save(step)` is called while batch `save_at` is in use. Returns (all, after)."""
    seen, after = [], []
    for step, batch in enumerate(loader):
        seen.append(_values(batch))
        if step == save_at:
            save(step)
        elif save_at is not None and step > save_at:
            after.append(_values(batch))
    return seen, after


def _dispatched_resume(save_at, length, even_batches=True):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even_batches, **STATEFUL))
    loader = accelerator.prepare(DataLoader(Stream(length), batch_size=2))
    states = {}
    _, after = _run(loader, save_at, lambda step: states.setdefault("saved", loader.state_dict()))
    states["end"] = loader.state_dict()
    loader.load_state_dict(states["saved"])
    resumed, _ = _run(loader)
    return type(loader).__name__, states, after, resumed, loader.iteration


def test_dispatched_loader_resumes_after_the_batch_in_use_on_every_rank():
    # 22 samples, global batches of 4 (2 per rank): 6 steps, the last one of 2 samples (1 per rank)
    results = run_on_ranks(_dispatched_resume, 2, 2, 22)
    (kind, states, after, resumed, iteration), (_, states_1, after_1, resumed_1, _) = results
    assert kind == "StatefulDataLoaderDispatcher"
    assert after == resumed == [[12, 13], [16, 17], [20]] and after_1 == resumed_1 == [[14, 15], [18, 19], [21]]
    assert states == states_1  # process 0's position, reported by every process
    assert states["end"]["_iterator_finished"] and states["end"]["_accel_iteration"] == 1
    assert iteration == 1  # the resumed epoch 0 is over


def test_dispatched_loader_saved_at_its_last_batch_resumes_with_the_next_epoch():
    (_, _, after, resumed, iteration), (_, _, _, resumed_1, _) = run_on_ranks(_dispatched_resume, 2, 5, 22)
    assert after == [] and resumed == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20]]
    assert resumed_1 == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [21]] and iteration == 2  # epoch 1 ran


def test_dispatched_loader_without_even_batches_ends_in_the_same_state_everywhere():
    # 21 samples: the last global batch holds 1 sample, which only process 0 gets
    (_, states, *_), (_, states_1, *_) = run_on_ranks(_dispatched_resume, 2, 1, 21, False)
    assert states == states_1 and states["end"]["_iterator_finished"]


def _sharded_resume(save_at):
    torch.manual_seed(0)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**STATEFUL))
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    saved = {}
    _, after = _run(loader, save_at, lambda step: saved.setdefault("state", loader.state_dict()))
    loader.load_state_dict(saved["state"])
    resumed, _ = _run(loader)
    return type(loader).__name__, after, resumed


def test_sharded_map_style_loader_resumes_in_the_same_shuffled_order():
    (kind, after, resumed), (_, after_1, resumed_1) = run_on_ranks(_sharded_resume, 2, 1)
    assert kind == "StatefulDataLoaderShard"
    assert after == resumed and after_1 == resumed_1 and len(after) == 3
    assert sorted(sum(after + after_1, [])) != sorted(range(20))  # the first batches are not replayed


def _save_state_round_trip(folder, per_rank):
    torch.manual_seed(0)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**STATEFUL))
    if per_rank:  # each process its own folder, as HF's test_distributed_data_loop does with TemporaryDirectory
        folder = os.path.join(folder, f"rank{accelerator.process_index}")
        os.makedirs(folder)  # (so that the checkpoints are staged beside and published, not written in place)
    dispatched = accelerator.prepare(DataLoader(Stream(22), batch_size=2))
    sharded = accelerator.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    first = os.path.join(folder, "first")
    second = os.path.join(folder, "second")
    _, dispatched_after = _run(dispatched, 2, lambda step: accelerator.save_state(first))
    _, sharded_after = _run(sharded, 3, lambda step: accelerator.save_state(second))
    files = sorted(name for name in os.listdir(first) if name.startswith(("dl_state_dict", "sampler")))
    accelerator.load_state(first)
    dispatched_resumed, _ = _run(dispatched)
    accelerator.load_state(second)
    sharded_resumed, _ = _run(sharded)
    next_epoch, _ = _run(dispatched)  # `second` saved the dispatched loader after its epoch: the next one is whole
    return (
        files,
        dispatched_after == dispatched_resumed,
        sharded_after == sharded_resumed,
        len(sharded_after),
        len(next_epoch),
        sorted(n for n in os.listdir(folder) if n.startswith(".")),
    )


@pytest.mark.parametrize("per_rank", [False, True], ids=["shared-folder", "folder-per-process"])
def test_save_state_and_load_state_resume_stateful_loaders(tmp_path, per_rank):
    for files, dispatched_ok, sharded_ok, sharded_left, next_epoch, hidden in run_on_ranks(
        _save_state_round_trip, 2, str(tmp_path), per_rank, timeout=180
    ):
        assert files == ["dl_state_dict.bin", "dl_state_dict_1.bin", "sampler.bin", "sampler_1.bin"]
        assert dispatched_ok and sharded_ok and sharded_left == 1 and next_epoch == 6
        assert hidden == []  # no staging folder left behind, also by the process that is not the main one


def test_checkpointing_functions_save_and_restore_a_stateful_loader(tmp_path):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**STATEFUL))
    loader = accelerator.prepare(DataLoader(torch.arange(10), batch_size=2))
    save = lambda step: save_accelerator_state(tmp_path, [], [], [], [loader], 0, step)  # noqa: E731
    _, after = _run(loader, 1, save)
    assert (tmp_path / "dl_state_dict.bin").exists()
    load_accelerator_state(tmp_path, [], [], [], [loader], 0)
    assert _run(loader)[0] == after == [[4, 5], [6, 7], [8, 9]]


def test_a_plain_stateful_dataloader_state_loads(tmp_path):
    """A state without accel's epoch key (torchdata's own, as HF Accelerate saves it) resumes the position."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    plain = StatefulDataLoader(torch.arange(10), batch_size=2)
    iterator = iter(plain)
    next(iterator), next(iterator)
    loader = Accelerator(dataloader_config=DataLoaderConfiguration(**STATEFUL)).prepare(
        DataLoader(torch.arange(10), batch_size=2)
    )
    loader.load_state_dict(plain.state_dict())
    assert _run(loader)[0] == [[4, 5], [6, 7], [8, 9]] and loader.iteration == 1


def test_hf_s_constructors_take_use_stateful_dataloader():
    import pickle

    from accel.data import DataLoaderAdapter, DataLoaderShard, SkipDataLoader

    shard = DataLoaderShard(torch.arange(6), batch_size=2, use_stateful_dataloader=True)
    assert type(shard).__name__ == "StatefulDataLoaderShard" and isinstance(shard, DataLoaderAdapter)
    assert shard.use_stateful_dataloader and not DataLoaderShard(torch.arange(6)).use_stateful_dataloader
    assert type(pickle.loads(pickle.dumps(shard))) is type(shard)
    # A skipping loader resumed within its epoch does not skip again; a new epoch skips as usual.
    skipping = SkipDataLoader(Stream(8), skip_batches=1, batch_size=2, use_stateful_dataloader=True)
    saved = {}
    first, after = _run(skipping, 0, lambda step: saved.setdefault("state", skipping.state_dict()))
    resumed = SkipDataLoader(Stream(8), skip_batches=1, batch_size=2, use_stateful_dataloader=True)
    resumed.load_state_dict(saved["state"])
    assert first == [[2, 3], [4, 5], [6, 7]] and _run(resumed)[0] == after == [[4, 5], [6, 7]]
    assert _run(resumed)[0] == first
