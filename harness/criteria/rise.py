"""``rise_by``: the value at the window's end minus the value at its start, at least ``min_rise`` (or, with
``n``, ``min_rise_count`` solved problems)."""

from __future__ import annotations

import math
from typing import Any

from harness.criteria.criterion import Criterion, Result, SpecError, Status, fmt, not_yet
from harness.criteria.scalars import BrokenCount, count_of, evals_text, scalar_series
from harness.run_data import RunData


def check_rise(c: Criterion) -> None:
    """The spec's rise has two points, and with ``n`` the count ``min_rise`` asks for stated exactly."""
    if c.window.first == c.window.last:
        raise SpecError(f"{c.where}: a rise needs two points: 'window' = [from, to] with from < to")
    n = c["n"]
    if n is None:
        if c["min_rise_count"] is not None:
            raise SpecError(f"{c.where}: 'min_rise_count' needs 'n'")
        return
    expected = math.ceil(c["min_rise"] * n - 1e-9)
    if c["min_rise_count"] != expected:
        raise SpecError(f"{c.where}: 'min_rise_count' must be {expected}: the smallest count k with k/{n} >= "
                        f"{c['min_rise']} (got {c['min_rise_count']})")


def rise_by(c: Criterion, run: RunData) -> Result:
    """The value at the window's end minus the one at its start is at least ``min_rise`` (or, with ``n``, counts)."""
    metric, series = scalar_series(c, run)
    label = evals_text(metric)
    start = c.window.first
    end = c.window.last
    evidence: dict[str, Any] = {"metric": metric, "window": str(c.window),
                                "values": {i: series[i].value for i in sorted(series)}}
    if end is None:  # "the last": known only when the run is over
        later = [i for i in series if i > start]
        if not run.finished:
            return Result(c, Status.PENDING, f"{label}@{start} → the last {label}: run not finished", False,
                          evidence)
        end = max(later) if later else None
    first, last = series.get(start), series.get(end) if end is not None else None
    if first is None or last is None:
        absent = [i for i, p in ((start, first), (end, last)) if p is None]
        return not_yet(c, run, f"{metric}: no value at {label} " + ", ".join(
            "the last" if i is None else str(i) for i in absent), **evidence)
    rise = last.value - first.value
    evidence |= {"from": start, "to": end, "from_value": first.value, "to_value": last.value, "rise": rise}
    n = c["n"]
    text_values = f"{label}@{start} {fmt(first.value)} → {label}@{end} {fmt(last.value)}"
    if n is not None:
        try:
            k0, note0 = count_of(run, metric, first, n)
            k1, note1 = count_of(run, metric, last, n)
        except BrokenCount as e:
            return Result(c, Status.FAIL, f"{text_values}: {e}", True, evidence, last.where)
        evidence["notes"] = [x for x in (note0, note1) if x]
        if k0 is not None and k1 is not None:
            evidence |= {"from_count": k0, "to_count": k1, "rise_count": k1 - k0}
            ok = k1 - k0 >= c["min_rise_count"]
            text = (f"{label}@{start} {k0}/{n} ({fmt(first.value)}) → {label}@{end} {k1}/{n} ({fmt(last.value)}): "
                    f"{k1 - k0:+d} of {n} ({fmt(rise, 3)}) {'≥' if ok else '<'} +{c['min_rise_count']} "
                    f"(+{fmt(c['min_rise'])} as printed)")
            return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence, last.where)
    ok = math.isfinite(rise) and rise >= c["min_rise"] - 1e-12
    text = f"{text_values}: {rise:+.3f} {'≥' if ok else '<'} +{fmt(c['min_rise'])}"
    return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence, last.where)
