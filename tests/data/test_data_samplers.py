"""BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler and SkipBatchSampler, without processes."""

import itertools

import pytest
import torch
from data_fixtures import Stream
from torch.utils.data import BatchSampler

from accel.data import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler


def shards(batch_sampler, world, **kwargs):
    return [list(BatchSamplerShard(batch_sampler, world, rank, **kwargs)) for rank in range(world)]


def steps_in_rank_order(per_rank):
    """The samples of step 0 of rank 0, 1, ..., then step 1...: what gathering at every step returns."""
    flat = []
    for step in itertools.zip_longest(*per_rank):
        flat += [index for batch in step if batch is not None for index in batch]
    return flat


# --- HF Accelerate's documented examples ---------------------------------------------------------------------------


def test_docstring_example_whole_and_split_batches():
    batch_sampler = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards(BatchSampler(range(8), 4, False), 2) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert shards(BatchSampler(range(8), 4, False), 2, split_batches=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert list(BatchSampler(range(8), 4, False)) == batch_sampler


@pytest.mark.parametrize(
    ("length", "drop_last", "even", "expected"),
    [
        (
            21,
            False,
            True,
            [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]], [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]]],
        ),
        (
            22,
            False,
            True,
            [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]], [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 0, 1]]],
        ),
        (
            20,
            False,
            True,
            [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 0]], [[3, 4, 5], [9, 10, 11], [15, 16, 17], [1, 2, 3]]],
        ),
        (20, True, True, [[[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]]]),
        (
            21,
            False,
            False,
            [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]]],
        ),
        (2, False, True, [[[0, 1, 0]], [[1, 0, 1]]]),
    ],
)
def test_hf_examples_without_split(length, drop_last, even, expected):
    batch_sampler = BatchSampler(range(length), batch_size=3, drop_last=drop_last)
    assert shards(batch_sampler, 2, even_batches=even) == expected


def test_hf_examples_with_split():
    assert shards(BatchSampler(range(22), 4, False), 2, split_batches=True)[1][-2:] == [[18, 19], [0, 1]]
    assert shards(BatchSampler(range(21), 4, False), 2, split_batches=True, even_batches=False) == [
        [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20]],
        [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]],
    ]


def test_varying_batch_sizes_are_completed_with_whole_batches():
    batch_sampler = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]]
    assert shards(batch_sampler, 3) == [[[0, 1, 2], [9]], [[3, 4], [0, 1, 2]], [[5, 6, 7, 8], [3, 4]]]
    assert shards(batch_sampler, 3, even_batches=False) == [[[0, 1, 2], [9]], [[3, 4]], [[5, 6, 7, 8]]]


def test_split_batches_needs_a_multiple_of_the_processes():
    with pytest.raises(ValueError, match="round multiple"):
        BatchSamplerShard(BatchSampler(range(8), 3, False), 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="round multiple"):
        IterableDatasetShard(Stream(8), 3, num_processes=2, split_batches=True)


def test_iterable_docstring_example():
    def shard(rank, **kwargs):
        return list(IterableDatasetShard(Stream(8), 4, num_processes=2, process_index=rank, **kwargs))

    assert [shard(0), shard(1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [shard(0, split_batches=True), shard(1, split_batches=True)] == [[0, 1, 4, 5], [2, 3, 6, 7]]


# --- Brute force: every small configuration ------------------------------------------------------------------------

GRID = list(itertools.product(range(14), range(1, 5), (1, 2, 4), (False, True), (False, True), (False, True)))


def _kept(length, batch, world, drop_last, split):
    """How many samples a pass keeps: all, or the full global batches with drop_last."""
    total = batch if split else batch * world
    return length // total * total if drop_last else length


@pytest.mark.parametrize("world", (1, 2, 4))
def test_batch_sampler_shard_covers_every_sample_in_order(world):
    for length, batch, _, drop_last, split, even in (case for case in GRID if case[2] == world):
        if split and batch % world:
            continue
        case = (length, batch, world, drop_last, split, even)
        per_rank = shards(BatchSampler(range(length), batch, drop_last), world, split_batches=split, even_batches=even)
        for rank, batches in enumerate(per_rank):
            shard = BatchSamplerShard(BatchSampler(range(length), batch, drop_last), world, rank, split, even)
            assert len(shard) == len(batches), case
            if even or drop_last:
                assert len(batches) == len(per_rank[0]), case
                assert all(len(b) == (batch // world if split else batch) for b in batches), case
        kept = _kept(length, batch, world, drop_last, split)
        flat = steps_in_rank_order(per_rank)
        assert flat[:kept] == list(range(kept)), case
        assert all(0 <= index < length for index in flat[kept:]), case
        if not even or drop_last:
            assert len(flat) == kept, case


@pytest.mark.parametrize("world", (1, 2, 4))
def test_iterable_dataset_shard_covers_every_sample_in_order(world):
    for length, batch, _, drop_last, split, _even in (case for case in GRID if case[2] == world and case[5]):
        if split and batch % world:
            continue
        case = (length, batch, world, drop_last, split)
        per_rank = []
        for rank in range(world):
            shard = IterableDatasetShard(Stream(length), batch, drop_last, world, rank, split)
            samples = list(shard)
            assert len(shard) == len(samples), case
            size = shard.process_batch_size
            per_rank.append([samples[i : i + size] for i in range(0, len(samples), size)])
        kept = _kept(length, batch, world, drop_last, split)
        flat = steps_in_rank_order(per_rank)
        assert flat[:kept] == list(range(kept)), case
        assert all(0 <= index < length for index in flat[kept:]), case


# --- SeedableRandomSampler and SkipBatchSampler ---------------------------------------------------------------------


def test_seedable_sampler_depends_on_seed_and_epoch_only():
    first, second = SeedableRandomSampler(range(20), data_seed=3), SeedableRandomSampler(range(20), data_seed=3)
    torch.manual_seed(123)
    epoch0 = list(first)
    assert first.epoch == 1
    epoch1 = list(first)
    assert sorted(epoch0) == list(range(20)) and epoch0 != epoch1
    second.set_epoch(1)
    assert list(second) == epoch1
    second.set_epoch(0)
    assert list(second) == epoch0


def test_skip_batch_sampler():
    skipped = SkipBatchSampler(BatchSampler(range(10), 3, False), 2)
    assert list(skipped) == [[6, 7, 8], [9]]
    assert len(skipped) == 2 and skipped.total_length == 4 and skipped.batch_size == 3
