"""Dynamic batch size as the recipe runs it (``--use-dynamic-batch-size --max-tokens-per-gpu N --balance-data``):
which sequences each data-parallel rank trains on, how many micro-batches, which sequences share one, and how the
loss is normalised. Pure functions of the sequence lengths, so every rank computes the same plan.

The rule (miles ``ray/rollout.py`` ``_split_train_data_by_dp`` and ``backends/megatron_utils/data.py``
``get_data_iterator``, ``utils/data.py``, ``utils/seqlen_balancing.py``):

1. **Across data-parallel ranks** (``--balance-data``): the global batch is split into ``DP`` parts of (nearly)
   equal total length by Karmarkar-Karp (largest differencing) with equal sample counts per rank; when the count
   does not divide, with unequal counts (miles' fallback).
2. **How many micro-batches**: on each rank, first-fit bin packing of its samples' lengths (in their order) into
   bins of ``max_tokens_per_gpu × CP`` tokens (under context parallelism a rank holds ``1 / CP`` of each
   sequence); the count is the number of bins. Every rank takes the *largest* count over the DP ranks (megatron's
   schedule and the expert all-to-all need the same number of micro-batches everywhere).
3. **Which sequences share a micro-batch**: each rank's samples are split into that many micro-batches of nearly
   equal total length by Karmarkar-Karp, with free sample counts. A micro-batch may exceed the token budget by
   up to its longest sequence: the first-fit count is the target, the balance is what is kept (the recipe's
   behaviour). A sequence longer than the budget gets a micro-batch to itself, never split.

The loss (miles ``loss.py`` without ``--calculate-per-token-loss``, the recipe's setting): each sample's per-token
loss is averaged over its own loss-mask tokens, and those sample means are averaged over the global batch
(``sum_of_sample_mean / global_batch_size``). So a sample weighs the same whatever its length and whatever
micro-batch it lands in: :func:`sample_mean_weights` gives the per-token weights whose weighted sum is that loss.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

__all__ = ["balanced_partitions", "first_fit_count", "packed_bounds", "plan_micro_batches", "sample_mean_weights"]


def first_fit_count(lengths: Sequence[int], capacity: int) -> int:
    """Number of bins first-fit packing puts ``lengths`` (in order) into, bins of ``capacity`` tokens; an item
    longer than ``capacity`` gets a bin of its own. 0 for no items."""
    _check_lengths(lengths, "first_fit_count")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"first_fit_count: capacity={capacity!r}: expected an integer >= 1")
    bins: list[int] = []
    for n in lengths:
        for i, used in enumerate(bins):
            if used + n <= capacity:
                bins[i] += n
                break
        else:
            bins.append(n)
    return len(bins)


def balanced_partitions(lengths: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split the indices of ``lengths`` into ``k`` non-empty parts of nearly equal total length (Karmarkar-Karp's
    largest differencing method). ``equal_size``: every part holds ``len / k`` items (``len`` a multiple of
    ``k``). Each part is sorted; parts are ordered by their first index. Needs ``len(lengths) >= k``."""
    _check_lengths(lengths, "balanced_partitions")
    n = len(lengths)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"balanced_partitions: k={k!r}: expected an integer >= 1")
    if n < k:
        raise ValueError(f"balanced_partitions: {n} items cannot fill {k} non-empty parts")
    if equal_size and n % k:
        raise ValueError(f"balanced_partitions: equal_size needs the {n} items to be a multiple of k={k}")
    # A state is k (sum, items) subsets; its spread is max sum - min sum. Start from one state per item (or, for
    # equal sizes, per group of k consecutive items of the sorted order: one item in each subset), then repeatedly
    # merge the two states of largest spread, pairing the heaviest subset of one with the lightest of the other.
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    if equal_size:
        seeds = [[(lengths[i], [i]) for i in order[j:j + k]] for j in range(0, n, k)]
    else:
        seeds = [[(lengths[i], [i])] + [(0, [])] * (k - 1) for i in order]
    heap = []
    for tie, subsets in enumerate(seeds):
        heapq.heappush(heap, _state(subsets, tie))
    tie = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: s[0], reverse=True)
        b = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        heapq.heappush(heap, _state(merged, tie))
        tie += 1
    parts = [sorted(items) for _, items in heap[0][2]]
    return sorted(parts, key=lambda p: p[0])


def _state(subsets: list[tuple[int, list[int]]], tie: int):
    sums = [s for s, _ in subsets]
    return (-(max(sums) - min(sums)), tie, subsets)


def plan_micro_batches(lengths: Sequence[int], dp_size: int, max_tokens_per_gpu: int,
                       cp_size: int = 1) -> list[list[list[int]]]:
    """The recipe's dynamic batches for one optimizer step: ``plan[d][m]`` = the indices (into ``lengths``, the
    global batch's token counts) of micro-batch ``m`` of data-parallel rank ``d``. Every rank has the same number
    of micro-batches (at least 1); a micro-batch is empty only where a rank has fewer samples than that number."""
    _check_lengths(lengths, "plan_micro_batches")
    for name, v in (("dp_size", dp_size), ("max_tokens_per_gpu", max_tokens_per_gpu), ("cp_size", cp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_micro_batches: {name}={v!r}: expected an integer >= 1")
    n = len(lengths)
    if n >= dp_size:
        ranks = balanced_partitions(lengths, dp_size, equal_size=n % dp_size == 0)
    else:  # fewer samples than ranks: one each, the rest train on nothing
        ranks = [[i] for i in range(n)] + [[] for _ in range(dp_size - n)]
    capacity = max_tokens_per_gpu * cp_size
    count = max(1, *(first_fit_count([lengths[i] for i in mine], capacity) for mine in ranks))
    plan = []
    for mine in ranks:
        if len(mine) >= count:
            parts = balanced_partitions([lengths[i] for i in mine], count)
            plan.append([[mine[j] for j in part] for part in parts])
        else:
            plan.append([[i] for i in mine] + [[] for _ in range(count - len(mine))])
    return plan


def packed_bounds(lengths: Sequence[int], tp_size: int = 1, cp_size: int = 1, halo: int = 0) -> torch.Tensor:
    """The bounds ``[N + 1]`` (or ``[N + 2]``, host int64) of one packed row holding sequences of ``lengths``.

    Without context parallelism each sequence takes its own length; under CP it is padded after its last token
    (where padding changes nothing before it) to a multiple of ``2·CP`` tokens and to at least ``2·CP·halo``
    (each of its ``2·CP`` chunks holds the KDA conv halo, ``kernel − 1`` tokens). A last padding segment makes the
    row split over CP and, per CP rank, over TP (sequence parallelism); an empty row is that segment alone.
    """
    _check_lengths(lengths, "packed_bounds")
    for name, v in (("tp_size", tp_size), ("cp_size", cp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"packed_bounds: {name}={v!r}: expected an integer >= 1")
    if isinstance(halo, bool) or not isinstance(halo, int) or halo < 0:
        raise ValueError(f"packed_bounds: halo={halo!r}: expected an integer >= 0")
    shortest = 2 * cp_size * max(1, halo) if cp_size > 1 else 1
    unit = 2 * cp_size if cp_size > 1 else 1
    segments = [max(shortest, -(-n // unit) * unit) for n in lengths]
    used, row_unit = sum(segments), unit * tp_size
    tail = -used % row_unit
    while 0 < tail < shortest or used + tail == 0:
        tail += row_unit
    if tail:
        segments.append(tail)
    return torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.long)


def sample_mean_weights(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Per-token weights of the recipe's loss for packed sequences: ``mask_t / (tokens of t's sample · num_samples)``.

    Args:
        loss_mask: ``[T]`` (or ``[1, T]``) 0/1, the tokens whose loss counts.
        cu_seqlens: ``[N + 1]`` host int64 bounds of the samples (a padding segment has an empty mask).
        num_samples: the samples of the *global* batch (the recipe's ``global_batch_size``).

    Returns:
        float32 weights shaped like ``loss_mask``: ``Σ_t w_t · loss_t`` over every micro-batch and rank is the mean
        over samples of each sample's masked token mean. A sample with no masked token weighs nothing.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"sample_mean_weights: num_samples={num_samples!r}: expected an integer >= 1")
    flat = loss_mask.reshape(-1).float()
    cu = torch.as_tensor(cu_seqlens).to("cpu", torch.int64)
    if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != flat.numel() or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"sample_mean_weights: cu_seqlens {cu.tolist()[:8]} do not bound the {flat.numel()} tokens")
    lengths = (cu[1:] - cu[:-1]).to(flat.device)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=flat.device), lengths)
    counts = torch.zeros(lengths.numel(), device=flat.device).index_add_(0, seg, flat)
    weights = flat / (counts.clamp_min(1.0)[seg] * num_samples)
    return weights.view_as(loss_mask).float()


def _check_lengths(lengths: Sequence[int], what: str) -> None:
    bad = [x for x in lengths if isinstance(x, bool) or not isinstance(x, int) or x < 1]
    if bad:
        raise ValueError(f"{what}: lengths must be integers >= 1, got {bad[:4]}")
