"""Prepared dataloaders in one process: DataLoader semantics, GradientState bookkeeping, devices, truncation."""

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from data_fixtures import Stream
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from accel.data import (
    DataLoaderAdapter,
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    SkipDataLoader,
    gather_for_metrics,
    gather_for_metrics_truncation,
    prepare_data_loader,
    skip_first_batches,
)
from accel.data.dispatcher import pack, unpack
from accel.pytree import send_to_device
from accel.state import GradientState


def test_prepared_loader_keeps_dataloader_semantics():
    dataset = list(range(10))
    prepared = prepare_data_loader(DataLoader(dataset, batch_size=2), num_processes=2, process_index=1)
    assert isinstance(prepared, DataLoader) and isinstance(prepared, DataLoaderShard)
    assert prepared.dataset is dataset
    assert len(prepared) == 3 and prepared.batch_size is None  # batches come from the batch sampler
    assert prepared.batch_sampler.batch_size == 2 and isinstance(prepared.sampler, SequentialSampler)
    assert prepared.total_batch_size == 4 and prepared.total_dataset_length == 10
    assert [batch.tolist() for batch in prepared] == [[2, 3], [6, 7], [0, 1]]


def test_iterable_dataset_is_sharded_and_keeps_its_batch_size():
    prepared = prepare_data_loader(
        DataLoader(Stream(7), batch_size=4), num_processes=2, process_index=0, split_batches=True
    )
    assert prepared.batch_size == 2 and prepared.total_batch_size == 4 and len(prepared) == 2
    assert [batch.tolist() for batch in prepared] == [[0, 1], [4, 5]]


def test_end_of_dataloader_and_remainder_are_set_before_the_last_batch():
    state = GradientState()
    seen = []
    for rank in (0, 1):
        prepared = prepare_data_loader(DataLoader(range(7), batch_size=2), num_processes=2, process_index=rank)
        for batch in prepared:
            seen.append((rank, batch.tolist(), state.end_of_dataloader, state.remainder))
            assert state.active_dataloader is prepared
        assert not state.in_dataloader
    assert seen == [(0, [0, 1], False, 3), (0, [4, 5], True, 3), (1, [2, 3], False, 3), (1, [6, 0], True, 3)]


def test_remainder_without_even_batches_counts_each_rank_s_last_step():
    # 5 samples, batch 2, 2 processes: rank 1 has one batch (step 0: 4 real samples); rank 0 has two (step 1: 1)
    remainders = []
    for rank in (0, 1):
        prepared = prepare_data_loader(
            DataLoader(range(5), batch_size=2), num_processes=2, process_index=rank, even_batches=False
        )
        remainders.append([GradientState().remainder for _ in prepared])
    assert remainders == [[1, 1], [4]]


def test_breaking_out_of_a_loop_unregisters_the_loader():
    prepared = prepare_data_loader(DataLoader(range(8), batch_size=2))
    for _ in prepared:
        break
    assert not GradientState().in_dataloader


def test_nested_loaders_report_the_innermost():
    state = GradientState()
    outer = prepare_data_loader(DataLoader(range(2), batch_size=1))
    inner = prepare_data_loader(DataLoader(range(3), batch_size=2))
    for _ in outer:
        flags = [state.end_of_dataloader for _ in inner]
        assert flags == [False, True] and state.active_dataloader is outer
    assert not state.in_dataloader


@pytest.mark.parametrize("dispatch", (False, True))
def test_batches_are_put_on_the_device(dispatch):
    loader = DataLoader([{"x": torch.ones(2), "n": i} for i in range(4)], batch_size=2)
    prepared = prepare_data_loader(
        loader, device=torch.device("meta"), put_on_device=True, dispatch_batches=dispatch, non_blocking=True
    )
    assert isinstance(prepared, DataLoaderDispatcher if dispatch else DataLoaderShard)
    batches = list(prepared)
    assert len(batches) == 2
    assert all(b["x"].device.type == "meta" and b["n"].device.type == "meta" for b in batches)
    plain = prepare_data_loader(loader)
    assert next(iter(plain))["x"].device.type == "cpu"


def test_prepare_rejects_bad_combinations():
    with pytest.raises(ValueError, match="put_on_device"):
        prepare_data_loader(DataLoader(range(4)), dispatch_batches=True)
    with pytest.raises(ValueError, match="round multiple"):
        prepare_data_loader(DataLoader(range(4), batch_size=3), num_processes=2, process_index=0, split_batches=True)


def test_prepare_leaves_the_user_s_objects_alone():
    loader = DataLoader(range(8), batch_size=2, shuffle=True)
    rng_types = ["torch", "generator"]
    original_batch_sampler = loader.batch_sampler
    prepared = prepare_data_loader(
        loader, rng_types=rng_types, use_seedable_sampler=True, data_seed=3, num_processes=2, process_index=0
    )
    assert rng_types == ["torch", "generator"] and prepared.rng_types == ["torch"]
    assert loader.batch_sampler is original_batch_sampler and isinstance(loader.sampler, RandomSampler)
    assert not isinstance(loader.sampler, SeedableRandomSampler)
    assert isinstance(prepared.get_sampler(), SeedableRandomSampler)


def test_sampler_that_is_a_batch_sampler():
    loader = DataLoader(torch.arange(6), sampler=BatchSampler(SequentialSampler(range(6)), 2, False), batch_size=None)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=1)
    assert [batch.tolist() for batch in prepared] == [[2, 3], [0, 1]]
    assert prepared.total_batch_size == 4


def test_skip_first_batches_on_plain_and_prepared_loaders():
    plain = skip_first_batches(DataLoader(range(10), batch_size=3), 2)
    assert type(plain) is DataLoader and [b.tolist() for b in plain] == [[6, 7, 8], [9]] and len(plain) == 2
    stream = skip_first_batches(DataLoader(Stream(10), batch_size=3), 2)
    assert type(stream) is SkipDataLoader and isinstance(stream, DataLoaderAdapter)  # HF's classes
    assert [b.tolist() for b in stream] == [[6, 7, 8], [9]] and len(stream) == 2
    assert [GradientState().end_of_dataloader for _ in stream] == [False, True]  # (HF's never knows)
    prepared = prepare_data_loader(DataLoader(range(10), batch_size=2), num_processes=2, process_index=0)
    resumed = skip_first_batches(prepared, 1)
    assert isinstance(resumed, DataLoaderShard) and len(resumed) == 2
    assert [(b.tolist(), GradientState().remainder) for b in resumed] == [([4, 5], 2), ([8, 9], 2)]


# --- gather_for_metrics_truncation ----------------------------------------------------------------------------------


def _state(end, remainder, rows=None):
    return SimpleNamespace(
        end_of_dataloader=end, remainder=remainder, active_dataloader=SimpleNamespace(_last_global_rows=rows)
    )


Pair = namedtuple("Pair", "pred label")


def test_truncation_cuts_every_per_sample_leaf_at_the_end_only():
    gathered = {"out": Pair(torch.arange(8), torch.arange(8) * 2), "ids": [torch.arange(8).view(8, 1)]}
    assert gather_for_metrics_truncation(gathered, _state(False, 5, 8)) is gathered
    cut = gather_for_metrics_truncation(gathered, _state(True, 5, 8))
    assert isinstance(cut["out"], Pair) and cut["out"].pred.tolist() == [0, 1, 2, 3, 4]
    assert cut["out"].label.tolist() == [0, 2, 4, 6, 8] and cut["ids"][0].shape == (5, 1)


def test_truncation_leaves_other_leaves_and_unknown_remainders_alone():
    gathered = {"preds": torch.arange(8), "loss_per_rank": torch.ones(4), "scalar": torch.tensor(1.0), "tag": "x"}
    cut = gather_for_metrics_truncation(gathered, _state(True, 3, 8))
    assert cut["preds"].tolist() == [0, 1, 2] and cut["loss_per_rank"].shape == (4,)
    assert cut["scalar"].dim() == 0 and cut["tag"] == "x"
    assert gather_for_metrics_truncation(gathered, _state(True, -1, None))["preds"].shape == (8,)
    assert gather_for_metrics_truncation(torch.arange(8), _state(True, 3, None)).tolist() == [0, 1, 2]


def test_truncation_of_gather_object_lists():
    assert gather_for_metrics_truncation(list("abcdef"), _state(True, 4, 6), use_gather_object=True) == list("abcd")


def test_gather_for_metrics_on_one_process_returns_its_input_until_the_last_batch_cuts_it():
    outputs = {
        "out": Pair(torch.arange(8), torch.arange(8) * 2),
        "ids": [torch.arange(8).view(8, 1)],
        "per_rank": torch.ones(4),
        "scalar": torch.tensor(1.0),
    }
    assert gather_for_metrics(outputs, _state(False, 5, 8)) is outputs
    assert gather_for_metrics(outputs, _state(True, -1, None)) is outputs
    cut = gather_for_metrics(outputs, _state(True, 5, 8))
    assert isinstance(cut["out"], Pair) and cut["out"].pred.tolist() == [0, 1, 2, 3, 4]
    assert cut["out"].label.tolist() == [0, 2, 4, 6, 8] and cut["ids"][0].shape == (5, 1)
    assert cut["per_rank"].shape == (4,) and cut["scalar"].dim() == 0 and list(cut) == list(outputs)


def test_gather_for_metrics_gathers_anything_but_tensors_as_objects():
    assert gather_for_metrics(list("abcdef"), _state(True, 4, 6)) == list("abcd")
    tensors = [torch.arange(6), torch.arange(6)]
    assert gather_for_metrics(tensors, _state(True, 1, 2), use_gather_object=True) == tensors[:1]  # a list of 2 items


# --- Packing batches for the dispatcher -----------------------------------------------------------------------------


def test_pack_round_trips_every_dtype_and_shape():
    batch = {
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "int64": torch.arange(12).view(3, 4)[:, ::2],  # not contiguous
        "empty": torch.empty(0, 5),
        "c128": torch.randn(3, dtype=torch.complex128),
        "meta": ["a", 1],
    }
    structure, buffer = pack(batch)
    unpacked = unpack(structure, buffer.clone())
    assert unpacked["meta"] == ["a", 1]
    for key in ("bool", "bf16", "int64", "empty", "c128"):
        assert unpacked[key].dtype == batch[key].dtype and torch.equal(unpacked[key], batch[key])


def test_prepared_loaders_pickle():
    import pickle

    for dispatch in (False, True):
        prepared = prepare_data_loader(
            DataLoader(list(range(6)), batch_size=2), put_on_device=True, dispatch_batches=dispatch
        )
        for _ in prepared:
            pass
        restored = pickle.loads(pickle.dumps(prepared))
        assert type(restored) is type(prepared)
        assert [b.tolist() for b in restored] == [[0, 1], [2, 3], [4, 5]]


def test_remainder_is_unknown_without_lengths():
    class Endless(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    prepared = prepare_data_loader(DataLoader(Endless(), batch_size=2), num_processes=2, process_index=0)
    assert [GradientState().remainder for _ in prepared] == [-1, -1]
    unbatched = prepare_data_loader(DataLoader(range(3), batch_size=None))
    assert [GradientState().remainder for _ in unbatched] == [-1, -1, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", (False, True))
def test_batches_go_to_cuda_with_non_blocking_copies(dispatch):
    loader = DataLoader(torch.arange(8.0), batch_size=4, pin_memory=True)
    prepared = prepare_data_loader(
        loader, device=torch.device("cuda"), put_on_device=True, dispatch_batches=dispatch, non_blocking=True
    )
    batches = list(prepared)
    torch.cuda.synchronize()
    assert all(batch.is_cuda for batch in batches)
    assert torch.cat(batches).cpu().tolist() == list(range(8))


class Movable:
    """An object with its own `.to` (like torch_geometric's Data) that has no non_blocking argument."""

    def __init__(self, device="cpu"):
        self.device = device

    def to(self, device):
        return Movable(torch.device(device))


def test_batches_move_objects_with_their_own_to_method():
    moved = send_to_device({"a": [Movable()], "b": "text", "c": torch.ones(1)}, torch.device("meta"), True)
    assert moved["a"][0].device.type == "meta" and moved["b"] == "text" and moved["c"].device.type == "meta"
