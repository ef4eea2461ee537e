"""Dynamic batch size (``k3.megatron.packing``): the recipe's first-fit micro-batch count, Karmarkar-Karp balancing
over data-parallel ranks and micro-batches, and the per-sample-mean loss weights; their errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from k3.megatron.packing import (
    balanced_partitions,
    first_fit_count,
    packed_bounds,
    plan_micro_batches,
    sample_mean_weights,
)


# ---------------------------------------------------------------------------------------------- first fit
@pytest.mark.parametrize("lengths, capacity, count", [
    ([5, 3, 7, 2, 6], 10, 3),  # bins [5+3+2, 7, 6]: first fit in order, not sorted
    ([6, 6, 4, 4], 10, 2),
    ([12, 1], 10, 2),  # an item over the capacity gets its own bin
    ([], 10, 0),
    ([10, 10], 10, 2),
])
def test_first_fit_counts_bins_in_the_given_order(lengths, capacity, count):
    assert first_fit_count(lengths, capacity) == count


def test_first_fit_takes_the_lengths_in_their_order():
    # sorted decreasing (6, 5, 4, 4, 1) these fit in 2 bins; first fit in the given order needs 3, as the recipe's
    assert first_fit_count([1, 6, 5, 4, 4], 10) == 3
    assert first_fit_count([6, 5, 4, 4, 1], 10) == 2


# ---------------------------------------------------------------------------------------------- Karmarkar-Karp
def _sums(lengths, parts):
    return [sum(lengths[i] for i in p) for p in parts]


def _best_spread(lengths, k, equal_size):
    """Brute force: the smallest max-min spread over every assignment (tiny inputs only)."""
    n = len(lengths)
    best = None
    for labels in itertools.product(range(k), repeat=n):
        counts = [labels.count(j) for j in range(k)]
        if min(counts) == 0 or (equal_size and len(set(counts)) != 1):
            continue
        sums = [sum(lengths[i] for i in range(n) if labels[i] == j) for j in range(k)]
        spread = max(sums) - min(sums)
        best = spread if best is None else min(best, spread)
    return best


@pytest.mark.parametrize("equal_size", [False, True])
def test_balanced_partitions_cover_every_item_once_and_balance_the_sums(equal_size):
    rng = random.Random(0)
    for trial in range(20):
        k = rng.choice([2, 3])
        n = k * rng.choice([2, 3]) if equal_size else rng.randint(k, 7)
        lengths = [rng.randint(1, 40) for _ in range(n)]
        parts = balanced_partitions(lengths, k, equal_size=equal_size)
        assert len(parts) == k and all(parts)
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(p == sorted(p) for p in parts) and [p[0] for p in parts] == sorted(p[0] for p in parts)
        if equal_size:
            assert {len(p) for p in parts} == {n // k}
        spread = max(_sums(lengths, parts)) - min(_sums(lengths, parts))
        # the differencing heuristic is near-optimal on small inputs: within the largest item of the optimum
        assert spread <= _best_spread(lengths, k, equal_size) + max(lengths), (lengths, parts)


def test_balanced_partitions_known_case():
    # the classic example: {8, 7, 6, 5, 4} into 2 -> differencing gives sums 16 / 14 (the optimum is 15 / 15)
    parts = balanced_partitions([8, 7, 6, 5, 4], 2)
    assert sorted(_sums([8, 7, 6, 5, 4], parts)) == [14, 16]
    parts = balanced_partitions([4, 4, 4, 4], 2, equal_size=True)
    assert _sums([4] * 4, parts) == [8, 8]


def test_balanced_partitions_is_deterministic():
    lengths = [9, 3, 3, 9, 5, 5, 1]
    assert balanced_partitions(lengths, 3) == balanced_partitions(list(lengths), 3)


# ---------------------------------------------------------------------------------------------- the plan
def test_plan_follows_the_recipe_rule():
    lengths = [30, 10, 25, 5, 20, 15, 8, 12]
    plan = plan_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=40)
    # 1. DP: equal counts (8 % 2 == 0), nearly equal tokens
    per_rank = [sorted(i for mb in rank for i in mb) for rank in plan]
    assert [len(r) for r in per_rank] == [4, 4]
    assert sorted(i for r in per_rank for i in r) == list(range(8))
    assert per_rank == balanced_partitions(lengths, 2, equal_size=True)
    # 2. the micro-batch count: the largest first-fit count over the ranks, the same on every rank
    counts = [first_fit_count([lengths[i] for i in r], 40) for r in per_rank]
    assert {len(rank) for rank in plan} == {max(counts)}
    # 3. each rank's micro-batches: Karmarkar-Karp over its own samples
    for rank, mine in zip(plan, per_rank):
        expected = [[mine[j] for j in part] for part in balanced_partitions([lengths[i] for i in mine], len(rank))]
        assert rank == expected


def test_plan_budget_scales_with_context_parallelism():
    lengths = [16, 16, 16, 16]
    assert len(plan_micro_batches(lengths, 1, 32)[0]) == 2
    assert len(plan_micro_batches(lengths, 1, 32, cp_size=2)[0]) == 1  # each CP rank holds half of every sequence


def test_plan_fills_micro_batches_up_to_the_budget_when_lengths_allow():
    rng = random.Random(3)
    lengths = [rng.randint(50, 500) for _ in range(64)]
    plan = plan_micro_batches(lengths, dp_size=4, max_tokens_per_gpu=2048)
    for rank in plan:
        sums = [sum(lengths[i] for i in mb) for mb in rank]
        # balanced: every micro-batch within the longest sequence of the mean, and the count is first fit's
        assert max(sums) - min(sums) <= max(lengths)
        assert len(rank) == max(first_fit_count([lengths[i] for i in mb2], 2048)
                                for mb2 in ([i for mb in r for i in mb] for r in plan))


def test_plan_with_fewer_samples_than_ranks_or_micro_batches_pads_with_empty_micro_batches():
    plan = plan_micro_batches([5, 7], dp_size=3, max_tokens_per_gpu=100)
    assert plan == [[[0]], [[1]], [[]]]
    plan = plan_micro_batches([90, 80, 70, 5], dp_size=2, max_tokens_per_gpu=100)
    assert {len(r) for r in plan} == {2} and sorted(i for r in plan for mb in r for i in mb) == [0, 1, 2, 3]
    odd = plan_micro_batches([9, 8, 7], dp_size=2, max_tokens_per_gpu=100)  # 3 % 2: unequal counts
    assert sorted(len([i for mb in r for i in mb]) for r in odd) == [1, 2]


@pytest.mark.parametrize("call, match", [
    (lambda: first_fit_count([3, 0], 10), "lengths must be integers >= 1"),
    (lambda: first_fit_count([3], 0), "capacity=0"),
    (lambda: balanced_partitions([1, 2], 3), "2 items cannot fill 3 non-empty parts"),
    (lambda: balanced_partitions([1, 2, 3], 2, equal_size=True), "multiple of k=2"),
    (lambda: balanced_partitions([1, 2], 0), "k=0"),
    (lambda: plan_micro_batches([4, 5], 0, 10), "dp_size=0"),
    (lambda: plan_micro_batches([4, 5], 1, 10, cp_size=True), "cp_size=True"),
    (lambda: plan_micro_batches([4, 2.5], 1, 10), "lengths must be integers"),
])
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------- the packed row
def test_packed_bounds_without_context_parallelism_keep_each_length():
    assert packed_bounds([5, 3, 7]).tolist() == [0, 5, 8, 15]
    assert packed_bounds([5, 3, 7], tp_size=4).tolist() == [0, 5, 8, 15, 16]  # a tail so TP splits the row
    assert packed_bounds([4, 4], tp_size=4).tolist() == [0, 4, 8]
    assert packed_bounds([], tp_size=2).tolist() == [0, 2]  # an empty micro-batch: the padding segment alone


def test_packed_bounds_under_context_parallelism_pad_each_sequence():
    # CP2: each sequence a multiple of 4 and at least 2·2·3 = 12 (every chunk holds the conv halo of 3)
    cu = packed_bounds([5, 13, 30], tp_size=2, cp_size=2, halo=3)
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert lengths[:3] == [12, 16, 32]
    assert int(cu[-1]) % (2 * 2 * 2) == 0 and all(n % 4 == 0 and n >= 12 for n in lengths)
    # a tail, when one is needed, is itself a valid packed sequence
    assert packed_bounds([12, 16], tp_size=2, cp_size=2, halo=3).tolist() == [0, 12, 16 + 12, 28 + 12]


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": [3, 0]}, "lengths must be integers >= 1"),
    ({"lengths": [3], "tp_size": 0}, "tp_size=0"),
    ({"lengths": [3], "halo": -1}, "halo=-1"),
])
def test_packed_bounds_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        packed_bounds(**kwargs)


# ---------------------------------------------------------------------------------------------- the loss
def test_sample_mean_weights_give_the_mean_of_sample_means():
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 15, 20])  # 3 samples and a padding segment
    mask = torch.zeros(1, 20)
    mask[0, 2:5] = 1
    mask[0, 6:12] = 1
    mask[0, 13:15] = 1
    loss = torch.randn(1, 20, generator=gen)
    w = sample_mean_weights(mask, cu, num_samples=6)  # the global batch has 6 samples (3 elsewhere)
    assert w.shape == mask.shape and w.dtype == torch.float32
    assert bool((w[mask == 0] == 0).all())
    means = [loss[0, a:b][mask[0, a:b].bool()].mean() for a, b in ((0, 5), (5, 12), (12, 15))]
    torch.testing.assert_close((w * loss).sum(), torch.stack(means).sum() / 6)


def test_sample_mean_weights_do_not_depend_on_how_samples_are_packed():
    lengths, masks = [4, 7, 3], [torch.tensor([0, 1, 1, 0.]), torch.tensor([0, 0, 1, 1, 1, 1, 1.]),
                                 torch.tensor([1, 1, 1.])]
    together = sample_mean_weights(torch.cat(masks), torch.tensor([0, 4, 11, 14]), 3)
    apart = torch.cat([sample_mean_weights(m, torch.tensor([0, len(m)]), 3) for m in masks])
    assert torch.equal(together, apart)
    assert together.sum().item() == pytest.approx(1.0)


def test_sample_mean_weights_errors():
    with pytest.raises(ValueError, match="num_samples=0"):
        sample_mean_weights(torch.ones(4), torch.tensor([0, 4]), 0)
    with pytest.raises(ValueError, match="do not bound the 4 tokens"):
        sample_mean_weights(torch.ones(4), torch.tensor([0, 3]), 1)
