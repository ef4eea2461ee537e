"""``returns_to_baseline`` and ``no_growth``: trainer memory per rank and weight sync, each reading against
its rank's baseline in its attempt (the first sync after the first optimizer step; startup syncs before it are
judged only for not being above it)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from harness.criteria.criterion import Criterion, Result, Status, fmt, not_yet
from harness.run_data import MemoryPoint, RunData, normalize_phase


def _memory_series(c: Criterion, run: RunData) -> tuple[str, dict[int, dict[int, MemoryPoint]]]:
    phase = normalize_phase(c["phase"])
    for metric in c.metrics:
        by_rank = run.memory_series(phase, metric)
        if by_rank:
            return metric, {r: {s: p for s, p in syncs.items() if c.window.contains(s)}
                            for r, syncs in sorted(by_rank.items())}
    return c.metric, {}


def _coverage_gaps(c: Criterion, run: RunData, by_rank: dict[int, dict[int, MemoryPoint]]) -> dict[int, list[int]]:
    """Ranks without a reading at syncs the run logged (a ``sync`` event, or another rank's reading).

    Excused: the last sync of an attempt that ended without a finished or failed status (killed mid-sync: the
    readings of the ranks that got theirs out are still judged) and, while the run goes on, the newest sync
    (its readings may still be arriving).
    """
    attempt_of: dict[int, int] = {}
    for syncs in by_rank.values():
        for s, p in syncs.items():
            attempt_of[s] = p.attempt
    for sp in run.syncs:
        if c.window.contains(sp.index):
            attempt_of.setdefault(sp.index, sp.attempt)
    required = set(attempt_of)
    for attempt in run.attempts:
        own = [s for s, a in attempt_of.items() if a == attempt.index]
        logs_statuses = attempt.started or attempt.resumed is not None  # else no end status is expected either
        if logs_statuses and attempt.end is None and own:
            required.discard(max(own))
    if not run.finished and attempt_of:
        required.discard(max(attempt_of))
    return {r: missing for r, syncs in sorted(by_rank.items())
            if (missing := sorted(s for s in required if s not in syncs))}


def _missing_text(gaps: dict[int, list[int]], ranks: int) -> str:
    first = min(s for missing in gaps.values() for s in missing)
    lacking = sorted(r for r, missing in gaps.items() if first in missing)
    syncs = sorted({s for missing in gaps.values() for s in missing})
    more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
    return (f"sync {first}: no reading of rank {lacking[0]}{more}; {len(syncs)} sync(s) lack readings of "
            f"{len(gaps)} of {ranks} rank(s), the criterion does not pass on fewer")


@dataclass(frozen=True)
class _Judged:
    """One memory reading against its reference: the attempt's baseline (or the absolute level)."""

    point: MemoryPoint
    reference: float  # GiB
    deviation: float  # GiB, value − reference (NaN when either is not finite)

    @property
    def bad_number(self) -> bool:
        return not math.isfinite(self.deviation)


def _judge_memory(by_rank: dict[int, dict[int, MemoryPoint]], absolute: float | None
                  ) -> tuple[list[_Judged], list[tuple[int, int]]]:
    """Every reading against its reference; and the (rank, sync) readings with none yet.

    The reference of a reading is ``absolute`` when given, else its rank's baseline in its attempt: the rank's
    first reading of that attempt that is not a startup one (the first sync after the attempt's first
    optimizer step). A startup reading of an attempt with no later reading has no baseline yet.
    """
    judged, unjudged = [], []
    for r, syncs in by_rank.items():
        baseline: dict[int, float] = {}
        for s in sorted(syncs):
            p = syncs[s]
            if not p.startup and p.attempt not in baseline:
                baseline[p.attempt] = absolute if absolute is not None else p.value
        for s in sorted(syncs):
            p = syncs[s]
            ref = absolute if absolute is not None else baseline.get(p.attempt)
            if ref is None:
                unjudged.append((r, s))
                continue
            dev = p.value - ref if math.isfinite(p.value) and math.isfinite(ref) else math.nan
            judged.append(_Judged(p, ref, dev))
    return judged, unjudged


def returns_to_baseline(c: Criterion, run: RunData) -> Result:
    """Per rank and attempt: startup syncs not above the baseline (+ tolerance); every later sync within it."""
    metric, by_rank = _memory_series(c, run)
    tol, side, absolute = c["tolerance_gb"], c["side"], c["baseline_gb"]
    phase = normalize_phase(c["phase"])
    if not by_rank or not any(by_rank.values()):
        return not_yet(c, run, f"no {metric} at {phase}", metric=metric, phase=phase)
    judged, unjudged = _judge_memory(by_rank, absolute)
    later = [j for j in judged if not j.point.startup]
    startup = [j for j in judged if j.point.startup]
    failures = [j for j in judged if j.bad_number or j.deviation > tol + 1e-9 or (
        not j.point.startup and side == "both" and j.deviation < -tol - 1e-9)]
    n_syncs = len({j.point.sync for j in later})
    startup_syncs = sorted({p.sync for syncs in by_rank.values() for p in syncs.values() if p.startup})
    references = sorted({j.reference for j in later if math.isfinite(j.reference)})
    evidence: dict[str, Any] = {
        "metric": metric, "phase": phase, "ranks": len(by_rank), "syncs": n_syncs, "tolerance_gb": tol,
        "baseline": "absolute" if absolute is not None else
        "per rank and attempt: its reading after the first sync that follows the first optimizer step",
        "startup_syncs": startup_syncs, "attempts": len({j.point.attempt for j in judged}) or 1,
    }
    if references:
        evidence |= {"baseline_gb_min": references[0], "baseline_gb_max": references[-1]}
    worst = max((j for j in later if not j.bad_number), key=lambda j: abs(j.deviation), default=None)
    if worst is not None:
        evidence |= {"worst_deviation_gb": abs(worst.deviation), "worst_rank": worst.point.rank,
                     "worst_sync": worst.point.sync}
    highest = max((j for j in startup if not j.bad_number), key=lambda j: j.deviation, default=None)
    if highest is not None:
        evidence |= {"startup_highest_deviation_gb": highest.deviation, "startup_highest_rank": highest.point.rank,
                     "startup_highest_sync": highest.point.sync}
    if unjudged:
        evidence["unjudged"] = [f"rank {r} sync {s}" for r, s in unjudged[:20]]
    reference = f"{fmt(absolute, 2)} GB" if absolute is not None else "baseline"
    if failures:
        first = min(failures, key=lambda j: (j.point.sync, j.point.rank))
        p, dev = first.point, first.deviation
        failing_ranks = sorted({j.point.rank for j in failures})
        evidence |= {"first_failing_sync": p.sync, "first_failing_rank": p.rank, "value_gb": p.value,
                     "baseline_gb": first.reference, "deviation_gb": dev, "failing_ranks": failing_ranks,
                     "failing_points": len(failures), "first_failing_is_startup": p.startup}
        against = reference if absolute is not None else f"baseline {fmt(first.reference, 2)} GB"
        at = f"at startup sync {p.sync}" if p.startup else f"after sync {p.sync}"
        if first.bad_number:
            broken = (f"the reading is {fmt(p.value)} GB" if not math.isfinite(p.value) else
                      f"its baseline is {fmt(first.reference)} GB")
            text = f"rank {p.rank} {at}: {broken}, not a number to judge"
        elif p.startup:
            text = (f"rank {p.rank} {at}: {fmt(p.value, 2)} GB is above {against} ({dev:+.2f} GB; a startup "
                    f"sync may be at most +{fmt(tol, 2)} GB above it)")
        else:
            text = (f"rank {p.rank} {at}: {fmt(p.value, 2)} GB vs {against} ({dev:+.2f} GB, tolerance "
                    f"±{fmt(tol, 2)} GB)")
        text += f"; {len(failing_ranks)} of {len(by_rank)} ranks fail"
        return Result(c, Status.FAIL, text, True, evidence, p.where)
    if n_syncs < c["min_syncs"]:
        return not_yet(c, run, f"{n_syncs} sync(s) after training of {len(by_rank)} rank(s); needs "
                       f"{c['min_syncs']}", **evidence)
    gaps = _coverage_gaps(c, run, by_rank)
    if gaps and run.finished:
        evidence["missing"] = {str(r): s for r, s in gaps.items()}
        return Result(c, Status.MISSING, _missing_text(gaps, len(by_rank)), True, evidence)
    text = (f"{len(by_rank)} ranks × {n_syncs} syncs within ±{fmt(tol, 2)} GB of {reference}"
            + (f" (worst {abs(worst.deviation):.2f} GB: rank {worst.point.rank}, sync {worst.point.sync})"
               if worst else ""))
    if highest is not None:
        lowest = min((j for j in startup if not j.bad_number), key=lambda j: j.deviation)
        text += (f"\nstartup sync{'s' if len(startup_syncs) > 1 else ''} {', '.join(map(str, startup_syncs))}: not "
                 f"above {reference} + {fmt(tol, 2)} GB (from {lowest.deviation:+.2f} to {highest.deviation:+.2f} GB)")
    if unjudged:
        text += f"\n{len(unjudged)} startup reading(s) of attempts with no later sync: no baseline to judge them by"
    if c.window.open and not run.finished:
        head, _, rest = text.partition("\n")
        return Result(c, Status.PENDING, head + " so far" + ("\n" + rest if rest else ""), False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through (xs, ys): Σ(x−x̄)(y−ȳ) / Σ(x−x̄)²; needs two distinct xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("slope of points that share one x")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def no_growth(c: Criterion, run: RunData) -> Result:
    """Least-squares slope per rank of the readings after training (startup syncs left out: the optimizer
    state is not there yet), each relative to its attempt's baseline so that a resume's new level is no trend."""
    metric, by_rank = _memory_series(c, run)
    phase, limit, need = normalize_phase(c["phase"]), c["max_slope_gb_per_sync"], c["min_points"]
    evidence: dict[str, Any] = {"metric": metric, "phase": phase, "max_slope_gb_per_sync": limit,
                                "ranks": len(by_rank)}
    judged, _ = _judge_memory(by_rank, None)
    bad = [j for j in judged if not j.point.startup and j.bad_number]
    if bad:
        p = min(bad, key=lambda j: (j.point.sync, j.point.rank)).point
        evidence |= {"first_failing_sync": p.sync, "first_failing_rank": p.rank}
        return Result(c, Status.FAIL, f"rank {p.rank} after sync {p.sync}: the reading is {fmt(p.value)} GB, not a "
                      "number to fit a slope to", True, evidence, p.where)
    points: dict[int, list[tuple[float, float]]] = {}
    for j in judged:
        if not j.point.startup:
            points.setdefault(j.point.rank, []).append((float(j.point.sync), j.deviation))
    slopes: dict[int, float] = {}
    for r, xy in points.items():
        if len(xy) >= need:
            slopes[r] = least_squares_slope([x for x, _ in xy], [y for _, y in xy])
    evidence["ranks_with_enough_points"] = len(slopes)
    if not slopes:
        most = max((len(xy) for xy in points.values()), default=0)
        return not_yet(c, run, f"{most} sync(s) after training per rank; the slope needs {need}", **evidence)
    worst_rank = max(slopes, key=lambda r: slopes[r])
    worst = slopes[worst_rank]
    evidence |= {"worst_rank": worst_rank, "worst_slope_gb_per_sync": worst,
                 "growing_ranks": sorted(r for r, s in slopes.items() if s > limit)}
    ok = worst <= limit + 1e-12
    text = (f"steepest: rank {worst_rank} {worst:+.4f} GB/sync over {len(points[worst_rank])} syncs "
            f"({'≤' if ok else '>'} {fmt(limit, 4)})")
    if not ok:
        # A trend can still flatten out: final only once the run is over.
        return Result(c, Status.FAIL, text, run.finished, evidence)
    if (c.window.open and not run.finished) or len(slopes) < len(by_rank):
        return (Result(c, Status.PENDING, text + " so far", False, evidence) if not run.finished else
                Result(c, Status.MISSING, f"{len(by_rank) - len(slopes)} rank(s) with fewer than {need} syncs",
                       True, evidence))
    gaps = _coverage_gaps(c, run, by_rank)
    if gaps:
        evidence["missing"] = {str(r): s for r, s in gaps.items()}
        return Result(c, Status.MISSING, _missing_text(gaps, len(by_rank)), True, evidence)
    return Result(c, Status.PASS, text, True, evidence)
