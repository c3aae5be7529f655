"""Prepared dataloaders on real gloo ranks: gather_for_metrics over full passes, shuffling, RNG sync, resuming.

Each rank function runs many configurations and returns what failed, so that one spawn covers a whole grid.
"""

import itertools

import torch
from data_fixtures import Stream
from spawn_pool import run_on_ranks
from torch.utils.data import DataLoader

from accel.collectives import gather_ragged
from accel.data import (
    SeedableRandomSampler,
    gather_for_metrics,
    gather_for_metrics_truncation,
    prepare_data_loader,
    set_seed,
    skip_first_batches,
    synchronize_rng_states,
)
from accel.pytree import recursively_apply
from accel.state import GradientState, PartialState


class Records(torch.utils.data.Dataset):
    """A map-style dataset of dicts (batches are dicts of tensors)."""

    def __init__(self, length):
        self.length = length

    def __getitem__(self, index):
        return {"idx": index, "pair": torch.tensor([index, -index])}

    def __len__(self):
        return self.length


def _indices(batch):
    return batch["idx"] if isinstance(batch, dict) else batch


def _eval_pass(prepared):
    """(samples gather_for_metrics kept, end_of_dataloader flags, batches of this rank, the steps where
    `gather_for_metrics` of a pytree differed from `gather_ragged` + `gather_for_metrics_truncation`): a plain user
    loop.

    Without even_batches a rank may have no batch in the last step; it stands by inside the loader while the
    others gather (accel.wire.uneven), so this loop must not hang.
    """
    state = GradientState()
    kept, ends, local, unlike = [], [], [], []
    for batch in prepared:
        rows = _indices(batch)
        ends.append(state.end_of_dataloader)
        local.append(rows.tolist())
        kept += gather_for_metrics_truncation(gather_ragged(rows)).tolist()
        outputs = {
            "batch": batch,
            "pair": (rows * 2, [rows[:, None]]),
            "scalar": torch.tensor(3),
            "per_process": torch.ones(1, 2),
        }
        ours, composed = gather_for_metrics(outputs), gather_for_metrics_truncation(gather_ragged(outputs))
        if _listed(ours) != _listed(composed):
            unlike.append((ours, composed))
        # A flat pair takes the direct path (accel.collectives.direct) outside the uneven step.
        pair = (rows * 2, rows.to(torch.int16))
        ours, composed = gather_for_metrics(pair), gather_for_metrics_truncation(gather_ragged(pair))
        if _listed(ours) != _listed(composed):
            unlike.append((ours, composed))
    return kept, ends, local, unlike


def _listed(data):
    return recursively_apply(lambda tensor: (tensor.dtype, tensor.tolist()), data)


def _expected(length, batch, world, drop_last, split):
    total = batch if split else batch * world
    return list(range(length // total * total if drop_last else length))


def _grid_on_rank():
    world = PartialState().num_processes
    failures = []
    grid = itertools.product(
        (1, 5, 7, 16), (1, 3, 4), (False, True), (False, True), (False, True), (False, True), ("map", "iterable")
    )
    for length, batch, drop_last, split, dispatch, even, kind in grid:
        if split and batch % world:
            continue
        case = dict(
            length=length, batch=batch, drop_last=drop_last, split=split, dispatch=dispatch, even=even, kind=kind
        )
        dataset = Records(length) if kind == "map" else Stream(length)
        loader = DataLoader(dataset, batch_size=batch, drop_last=drop_last)
        prepared = prepare_data_loader(
            loader,
            device=torch.device("cpu"),
            split_batches=split,
            put_on_device=True,
            dispatch_batches=dispatch,
            even_batches=even,
        )
        kept, ends, local, unlike = _eval_pass(prepared)
        expected = _expected(length, batch, world, drop_last, split)
        if unlike:
            ours, composed = unlike[0]
            failures.append(f"{case}: gather_for_metrics gave {ours}, gather_ragged + truncation {composed}")
        # Process 0 always has a batch in the last step; one standing by misses that step's samples.
        if kept != expected[: len(kept)] or (PartialState().is_main_process and kept != expected):
            failures.append(f"{case}: gather_for_metrics kept {kept}")
        if ends != [False] * (len(ends) - 1) + [True] * bool(ends):
            failures.append(f"{case}: end_of_dataloader flags {ends}")
        if len(local) != len(prepared):
            failures.append(f"{case}: {len(local)} batches but len() is {len(prepared)}")
    return failures


def _check_grid(world):
    for rank, failures in enumerate(run_on_ranks(_grid_on_rank, world, timeout=120)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures[:20])


def test_gather_for_metrics_exactly_once_in_order_one_process():
    _check_grid(1)


def test_gather_for_metrics_exactly_once_in_order_two_processes():
    _check_grid(2)


def test_gather_for_metrics_exactly_once_in_order_four_processes():
    _check_grid(4)


# --- Shuffling, set_epoch and RNG synchronization -------------------------------------------------------------------


def _shuffles_on_rank():
    rank = PartialState().process_index
    torch.manual_seed(100 + rank)  # ranks start out of sync on purpose
    loader = DataLoader(range(16), batch_size=2, shuffle=True)
    synced = prepare_data_loader(loader, rng_types=["generator"])
    synced_epochs = [_eval_pass(synced)[0] for _ in range(2)]
    seedable = prepare_data_loader(DataLoader(range(16), batch_size=2, shuffle=True), use_seedable_sampler=True)
    seedable.set_epoch(3)
    epoch3 = _eval_pass(seedable)[0]
    seedable.set_epoch(3)
    epoch3_again = _eval_pass(seedable)[0]
    torch.manual_seed(rank)
    synchronize_rng_states(["torch"])
    draws = torch.rand(3).tolist()
    set_seed(5, device_specific=True)
    return synced_epochs, epoch3, epoch3_again, draws, torch.initial_seed()


def test_shuffling_is_identical_on_every_rank_and_changes_with_the_epoch():
    results = run_on_ranks(_shuffles_on_rank, 2)
    (synced_epochs, epoch3, epoch3_again, draws, seed0), (_, _, _, draws1, seed1) = results
    assert results[0][:3] == results[1][:3]  # every rank gathered the same
    assert all(sorted(epoch) == list(range(16)) for epoch in synced_epochs)
    assert synced_epochs[0] != synced_epochs[1]
    assert epoch3 == epoch3_again and sorted(epoch3) == list(range(16))
    reference = SeedableRandomSampler(range(16), data_seed=100)  # rank 0's seed, broadcast to rank 1
    reference.set_epoch(3)
    assert epoch3 == list(reference)
    assert draws == draws1
    assert (seed0, seed1) == (5, 6)


# --- skip_first_batches -----------------------------------------------------------------------------------------


def _resume_on_rank():
    failures = []
    for split, dispatch in itertools.product((False, True), (False, True)):
        set_seed(11)
        loader = DataLoader(range(13), batch_size=2, shuffle=True)
        prepared = prepare_data_loader(
            loader, split_batches=split, put_on_device=True, dispatch_batches=dispatch, use_seedable_sampler=True
        )
        prepared.set_epoch(4)
        kept, _, local, _ = _eval_pass(prepared)
        resumed = skip_first_batches(prepared, 2)
        resumed.set_epoch(4)
        kept_after, ends_after, local_after, _ = _eval_pass(resumed)
        case = f"split={split} dispatch={dispatch}"
        if local_after != local[2:]:
            failures.append(f"{case}: resumed batches {local_after}, expected {local[2:]}")
        if kept_after != kept[2 * prepared.total_batch_size :]:
            failures.append(f"{case}: resumed gather_for_metrics {kept_after}, full pass {kept}")
        if not ends_after or not ends_after[-1] or len(local_after) != len(resumed):
            failures.append(f"{case}: end_of_dataloader {ends_after}, len {len(resumed)}")
    return failures


def test_skip_first_batches_resumes_with_exactly_the_unseen_batches():
    for rank, failures in enumerate(run_on_ranks(_resume_on_rank, 2)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _variable_batches_on_rank():
    # Joined pairs of batches: 5 rows (3 + 2 across the ranks), then a last 5 rows evened out to 3 + 3.
    loader = DataLoader(list(range(10)), batch_sampler=[[0, 1, 2], [3, 4], [5], [6, 7, 8, 9]])
    prepared = prepare_data_loader(loader, put_on_device=True, dispatch_batches=True)
    kept, ends, local, _ = _eval_pass(prepared)
    return kept, ends, local


def test_dispatcher_with_batches_of_varying_sizes():
    results = run_on_ranks(_variable_batches_on_rank, 2)
    assert [kept for kept, _, _ in results] == [list(range(10))] * 2
    assert [local for _, _, local in results] == [[[0, 1, 2], [5, 6, 7]], [[3, 4], [8, 9, 5]]]
    assert [ends for _, ends, _ in results] == [[False, True]] * 2


class _FailsAt(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        if index == 5:
            raise ValueError("sample 5 is corrupt")
        return torch.tensor(index)


def _dispatch_failing_dataset():
    loader = prepare_data_loader(
        torch.utils.data.DataLoader(_FailsAt(), batch_size=2),
        device=torch.device("cpu"),
        put_on_device=True,
        dispatch_batches=True,
    )
    try:
        for _ in loader:
            pass
    except (ValueError, RuntimeError) as error:
        return type(error).__name__, str(error)
    return None


def test_a_failing_loader_on_the_main_process_raises_on_every_process():
    (kind_0, message_0), (kind_1, message_1) = run_on_ranks(_dispatch_failing_dataset, 2, timeout=60)
    assert kind_0 == "ValueError" and message_0 == "sample 5 is corrupt"
    assert kind_1 == "RuntimeError" and "ValueError: sample 5 is corrupt" in message_1
