"""Which prompt records each rollout uses: a pure function of the rollout id, so a resumed run continues with
exactly the prompts an uninterrupted one would have used."""

from __future__ import annotations

import random

__all__ = ["prompts_for_rollout"]


def prompts_for_rollout(n_records: int, rollout_id: int, batch_size: int, seed: int, shuffle: bool) -> list[int]:
    """Record indices of rollout ``rollout_id``: epochs of a seeded permutation, so a resumed run continues
    with exactly the prompts an uninterrupted one would have used."""
    out: list[int] = []
    start = rollout_id * batch_size
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, n_records)
        order = list(range(n_records))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[i])
    return out
