"""``replicas_agree``: after every optimizer step, every replica of an adapter tensor has the same digest."""

from __future__ import annotations

from typing import Any

from harness.criteria.criterion import Criterion, Result, Status, not_yet
from harness.run_data import RunData


def replicas_agree(c: Criterion, run: RunData) -> Result:
    """After every optimizer step, the replicas of each adapter tensor on several ranks have one digest."""
    steps = sorted(run.replicas)  # (attempt, step), in run order
    ranks = sorted({r for by_rank in run.replicas.values() for r in by_rank})
    compared = 0
    labels: set[str] = set()
    evidence: dict[str, Any] = {"steps": len(steps), "ranks": ranks}
    for attempt, step in steps:
        by_rank = run.replicas[(attempt, step)]
        holders: dict[str, dict[str, list[int]]] = {}  # label -> digest -> ranks
        for rank, point in sorted(by_rank.items()):
            for label, digest in point.digests.items():
                holders.setdefault(label, {}).setdefault(digest, []).append(rank)
        labels.update(holders)
        for label in sorted(holders):
            sides = holders[label]
            if sum(len(r) for r in sides.values()) > 1:
                compared += 1
            if len(sides) > 1:
                groups = sorted(sides.values(), key=lambda g: (-len(g), g))
                where = next(p.where for p in by_rank.values() if p.seq == max(
                    by_rank[r].seq for g in groups for r in g))
                evidence |= {"first_failing_step": step, "tensor": label, "rank_groups": groups,
                             "digests": {d[:16]: g for d, g in sides.items()}, "attempt": attempt}
                split = " vs ".join("ranks " + ",".join(map(str, g)) if len(g) > 1 else f"rank {g[0]}" for g in groups)
                label_step = f"step {step}" + (f" (attempt {attempt + 1})" if run.attempts and len(run.attempts) > 1
                                               else "")
                return Result(c, Status.FAIL, f"{label_step}: replicas of {label} differ: {split}", True, evidence,
                              where)
    evidence |= {"tensors": len(labels), "replica_comparisons": compared}
    if len(steps) < c["min_steps"]:
        return not_yet(c, run, f"{len(steps)} step(s) with replica digests; needs {c['min_steps']}", **evidence)
    what = (f"{len(steps)} steps, {len(labels)} tensors on {len(ranks)} ranks: every replica equal "
            f"({compared} comparisons)" if len(ranks) > 1 else
            f"{len(steps)} steps, {len(labels)} tensors on one rank: no tensor has a replica to compare")
    if not run.finished:
        return Result(c, Status.PENDING, what + " so far", False, evidence)
    return Result(c, Status.PASS, what, True, evidence)
