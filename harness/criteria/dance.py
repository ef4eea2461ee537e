"""The memory dance (recipe §5.1, §5.4): ``resident_while_asleep`` (what a trainer rank keeps on the device
while it sleeps) and ``released_while_training`` (the engine releases its weights before every train step)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.criteria.criterion import Criterion, Result, Status, fmt, not_yet, passed
from harness.run_data import EventTime, RunData, normalize_phase

# What a trainer rank's allocator held before it slept, best first: reserved counts the cached blocks a sleep also
# empties; allocated alone would let freed cache hide what stayed.
HELD_METRICS = ("memory/reserved_gb", "memory/allocated_gb")


@dataclass(frozen=True)
class _Asleep:
    """What one trainer rank kept on the device while asleep after one sleep (the readings around it)."""

    rank: int
    sync: int
    held_gb: float  # the rank's allocator held (reserved, else allocated) before it slept
    freed_gb: float  # what left the whole device while it went to sleep
    where: str  # its after-sleep reading

    @property
    def resident_gb(self) -> float:
        return self.held_gb - self.freed_gb


def _asleep_readings(c: Criterion, run: RunData) -> tuple[str, str, list[_Asleep], list[str]]:
    """(physical metric, held metric, one :class:`_Asleep` per rank and sync with every reading, the readings
    that lack their pair: "rank 0 sync 5: no after_offload reading")."""
    before, after = normalize_phase(c["before_phase"]), normalize_phase(c["after_phase"])
    physical = next((m for m in c.metrics if run.memory_series(before, m) or run.memory_series(after, m)), c.metric)
    held_metric = next((m for m in HELD_METRICS if run.memory_series(before, m)), HELD_METRICS[-1])
    phys_b, phys_a = run.memory_series(before, physical), run.memory_series(after, physical)
    held = run.memory_series(before, held_metric)
    out: list[_Asleep] = []
    unpaired: list[str] = []
    for rank in sorted(set(phys_b) | set(phys_a) | set(held)):
        syncs = set(phys_b.get(rank, {})) | set(phys_a.get(rank, {})) | set(held.get(rank, {}))
        for sync in sorted(s for s in syncs if c.window.contains(s)):
            b, a, h = (series.get(rank, {}).get(sync) for series in (phys_b, phys_a, held))
            lacking = [f"{name} at {phase}" for name, phase, p in ((physical, before, b), (physical, after, a),
                                                                   (held_metric, before, h)) if p is None]
            if lacking:
                unpaired.append(f"rank {rank} sync {sync}: no {' and no '.join(lacking)}")
                continue
            out.append(_Asleep(rank, sync, h.value, b.value - a.value, a.where))  # type: ignore[union-attr]
    return physical, held_metric, out, unpaired


def resident_while_asleep(c: Criterion, run: RunData) -> Result:
    """Per trainer rank and sleep: held before the sleep − what left the device ≤ ``max_gb``."""
    before, after = normalize_phase(c["before_phase"]), normalize_phase(c["after_phase"])
    physical, held_metric, asleep, unpaired = _asleep_readings(c, run)
    limit = c["max_gb"]
    evidence: dict[str, Any] = {"physical_metric": physical, "held_metric": held_metric, "max_gb": limit,
                                "phases": [before, after], "sleeps": len(asleep),
                                "ranks": len({a.rank for a in asleep})}
    if not asleep and not unpaired:
        return not_yet(c, run, f"no {physical} at {before} and {after}", **evidence)
    broken = [a for a in asleep if not math.isfinite(a.resident_gb)]
    over = [a for a in asleep if math.isfinite(a.resident_gb) and a.resident_gb > limit + 1e-9]
    if broken or over:
        first = min(broken or over, key=lambda a: (a.sync, a.rank))
        evidence |= {"first_failing_rank": first.rank, "first_failing_sync": first.sync, "phase": after,
                     "resident_gb": first.resident_gb, "held_gb": first.held_gb, "freed_gb": first.freed_gb,
                     "failing_ranks": sorted({a.rank for a in broken + over})}
        if broken:
            text = (f"rank {first.rank} at {after} of sync {first.sync}: the readings are not numbers to judge (held "
                    f"{fmt(first.held_gb)} GB, freed {fmt(first.freed_gb)} GB)")
        else:
            held = held_metric.split("/")[-1].removesuffix("_gb")
            text = (f"rank {first.rank} at {after} of sync {first.sync}: {first.resident_gb:.2f} GB still on the "
                    f"device while asleep > {fmt(limit, 2)} GB ({held} {first.held_gb:.2f} GB before the sleep, "
                    f"{first.freed_gb:.2f} GB left the device)")
        return Result(c, Status.FAIL, text, True, evidence, first.where)
    if unpaired and run.finished:
        evidence["unpaired"] = unpaired[:20]
        return Result(c, Status.MISSING, f"{unpaired[0]}; {len(unpaired)} sleep(s) without every reading, the "
                      "criterion does not pass on fewer", True, evidence)
    syncs = len({a.sync for a in asleep})
    if syncs < c["min_syncs"] or not asleep:
        return not_yet(c, run, f"{syncs} sleep(s) with both readings; needs {c['min_syncs']}", **evidence)
    worst = max(asleep, key=lambda a: a.resident_gb)
    evidence |= {"worst_resident_gb": worst.resident_gb, "worst_rank": worst.rank, "worst_sync": worst.sync}
    text = (f"{evidence['ranks']} rank(s) × {syncs} sleeps: at most {worst.resident_gb:.2f} GB on the device while "
            f"asleep (rank {worst.rank}, sync {worst.sync}) ≤ {fmt(limit, 2)} GB")
    return passed(c, run, text, evidence)


def _trained_rollouts(run: RunData) -> dict[int, EventTime]:
    """The ``train`` event of every trained rollout (a later attempt's replaces an earlier one's)."""
    return {e.rollout_id: e for e in run.event_times if e.event == "train" and e.rollout_id is not None}


def released_while_training(c: Criterion, run: RunData) -> Result:
    """Per engine and trained rollout: a release of ``tag`` before the train event, no resume of it before that
    event, the engine not saying its weights stayed, and (``min_released_gb``) that much leaving the device."""
    tag, need_gb, physical = c["tag"], c["min_released_gb"], c.metric
    trains = {r: e for r, e in sorted(_trained_rollouts(run).items()) if c.window.contains(r)}
    engines = sorted({p.engine for p in run.engine_memory})
    evidence: dict[str, Any] = {"tag": tag, "min_released_gb": need_gb, "metric": physical, "engines": engines,
                                "rollouts": len(trains)}
    if not engines:
        return not_yet(c, run, "no engine memory readings (memory events with 'engine')", **evidence)
    freed_by: dict[str, float] = {}
    for rollout, train in trains.items():
        for engine in engines:
            mine = [p for p in run.engine_memory if p.engine == engine and p.rollout_id == rollout and tag in p.tags]
            released = [p for p in mine if p.phase == "after_release" and p.seq < train.seq]
            at = f"engine {engine}, rollout {rollout}"
            base = {"first_failing_engine": engine, "first_failing_rollout": rollout}
            if not released:
                evidence |= base | {"phase": "after_release"}
                return Result(c, Status.FAIL, f"{at}: no release of its {tag} before training (no after_release "
                              f"reading with tag {tag!r} before the train event)", True, evidence, train.where)
            rel = released[-1]
            sync = f" (sync {rel.sync})" if rel.sync is not None else ""
            base |= {"first_failing_sync": rel.sync}
            back = [p for p in mine if p.phase in ("before_resume", "after_resume") and rel.seq < p.seq < train.seq]
            if back:
                evidence |= base | {"phase": back[0].phase}
                return Result(c, Status.FAIL, f"{at}{sync}: {back[0].phase} of its {tag} before training ended: the "
                              "engine held them while the trainer trained", True, evidence, back[0].where)
            if rel.weights_resident is True and tag == "weights":
                evidence |= base | {"phase": "after_release"}
                return Result(c, Status.FAIL, f"{at}{sync}: after_release says its weights are still resident", True,
                              evidence, rel.where)
            if need_gb is None:
                continue
            before = [p for p in mine if p.phase == "before_release" and p.seq < rel.seq]
            start = before[-1].values.get(physical) if before else None
            end = rel.values.get(physical)
            if start is None or end is None:
                evidence |= base | {"phase": "before_release" if start is None else "after_release"}
                return Result(c, Status.MISSING if run.finished else Status.PENDING,
                              f"{at}{sync}: no {physical} at {'before_release' if start is None else 'after_release'}: "
                              f"what the release freed cannot be measured", run.finished, evidence, rel.where)
            freed = start - end
            freed_by[f"{engine}:{rollout}"] = freed
            if not math.isfinite(freed) or freed < need_gb - 1e-9:
                evidence |= base | {"phase": "after_release", "freed_gb": freed}
                return Result(c, Status.FAIL, f"{at}{sync}: the release of its {tag} freed {fmt(freed, 2)} GB of the "
                              f"device < {fmt(need_gb, 2)} GB: the {tag} stayed resident", True, evidence, rel.where)
    if freed_by:
        evidence |= {"least_freed_gb": min(freed_by.values()), "most_freed_gb": max(freed_by.values())}
    if len(trains) < c["min_rollouts"]:
        return not_yet(c, run, f"{len(trains)} trained rollout(s); needs {c['min_rollouts']}", **evidence)
    text = f"{len(engines)} engine(s) × {len(trains)} rollouts: {tag} released before every train step, resumed after"
    if freed_by:
        text += f" ({fmt(min(freed_by.values()), 2)}–{fmt(max(freed_by.values()), 2)} GB left the device)"
    return passed(c, run, text, evidence)
