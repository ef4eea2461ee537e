"""``band``: every value (or their mean) in [lo, hi], or, with ``n``, every solved count in the counts that
round into it."""

from __future__ import annotations

import statistics
from typing import Any

from harness.criteria.criterion import Criterion, Result, SpecError, Status, fmt, not_yet
from harness.criteria.params import decimals
from harness.criteria.scalars import BrokenCount, band_text, count_of, evals_text, in_band, scalar_series
from harness.run_data import RunData


def check_band(c: Criterion) -> None:
    """The spec's band is one: a bound given, lo ≤ hi, and with ``n`` the counts that round into it stated."""
    lo, hi, n = c["lo"], c["hi"], c["n"]
    if lo is None and hi is None:
        raise SpecError(f"{c.where}: a band needs 'lo', 'hi' or both")
    if lo is not None and hi is not None and lo > hi:
        raise SpecError(f"{c.where}: 'lo' {lo} is above 'hi' {hi}")
    if n is None:
        if c["lo_count"] is not None or c["hi_count"] is not None:
            raise SpecError(f"{c.where}: 'lo_count' / 'hi_count' need 'n' (the number of problems)")
        return
    if n <= 0:
        raise SpecError(f"{c.where}: 'n' must be positive, got {n}")
    if c["reduce"] != "each":
        raise SpecError(f"{c.where}: counts ('n') are judged per value: 'reduce' must be \"each\"")
    # The page rounds k/n to the decimals it prints; the counts must be exactly those that round into the band.
    for bound, count_name, pick in (("lo", "lo_count", min), ("hi", "hi_count", max)):
        value = c[bound]
        if value is None:
            continue
        digits = decimals(value)
        inside = [k for k in range(n + 1) if (lo is None or round(k / n, digits) >= lo - 1e-12) and (
            hi is None or round(k / n, digits) <= hi + 1e-12)]
        if not inside:
            raise SpecError(f"{c.where}: no count of {n} rounds into [{lo}, {hi}]")
        expected = pick(inside)
        if c[count_name] is None:
            raise SpecError(f"{c.where}: with 'n' = {n}, state '{count_name}' = {expected} (the count that "
                            f"rounds to {value})")
        if c[count_name] != expected:
            raise SpecError(f"{c.where}: '{count_name}' = {c[count_name]} disagrees with '{bound}' = {value}: "
                            f"{expected}/{n} is the {'smallest' if pick is min else 'largest'} count that "
                            f"rounds into [{lo}, {hi}]")


def band(c: Criterion, run: RunData) -> Result:
    """Every value in the window (or their mean) in the band; with ``n``, every solved count in its counts."""
    metric, series = scalar_series(c, run)
    lo, hi, n = c["lo"], c["hi"], c["n"]
    label = evals_text(metric)
    required = c.window.required()
    absent = [i for i in required if i not in series]
    values = {i: series[i].value for i in sorted(series)}
    evidence: dict[str, Any] = {"metric": metric, "window": str(c.window), "values": values}

    if c["reduce"] == "mean":
        if absent or not series:
            return not_yet(c, run, f"{metric}: {len(series)} of {len(required) or '≥1'} {label}s in "
                           f"{c.window}", **evidence, absent=absent)
        if c.window.open and not run.finished:
            return Result(c, Status.PENDING, f"{metric}: mean so far {fmt(statistics.fmean(values.values()))} "
                          "(open window)", False, evidence)
        mean = statistics.fmean(values.values())
        evidence["mean"] = mean
        ok = in_band(mean, lo, hi)
        text = (f"mean of {label}s {c.window}: {fmt(mean)} {'in' if ok else 'outside'} {band_text(lo, hi)}")
        return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence)

    counts: dict[int, int] = {}
    notes: list[str] = []
    for i, p in sorted(series.items()):
        count = None
        if n is not None:
            try:
                count, note = count_of(run, metric, p, n)
            except BrokenCount as e:
                evidence |= {"failing_index": i, "value": p.value, "counts": counts}
                return Result(c, Status.FAIL, f"{label}@{i}: {e}", True, evidence, p.where)
            if note:
                notes.append(f"{label}@{i}: {note}")
            if count is not None:
                counts[i] = count
        if count is not None:
            ok = c["lo_count"] is None or count >= c["lo_count"]
            ok = ok and (c["hi_count"] is None or count <= c["hi_count"])
        else:
            ok = in_band(p.value, lo, hi)
        if not ok:
            evidence |= {"failing_index": i, "value": p.value, "count": count, "counts": counts, "notes": notes}
            shown = f"{fmt(p.value)}" + (f" = {count}/{n}" if count is not None else "")
            return Result(c, Status.FAIL, f"{label}@{i}: {shown} outside {_band_text_counts(c)}", True,
                          evidence, p.where)
    if n is not None:
        evidence |= {"counts": counts, "notes": notes}
    if absent or not series:
        return not_yet(c, run, f"{metric}: no value at {label} {', '.join(map(str, absent or [c.window]))}",
                       **evidence, absent=absent)
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, f"{len(series)} {label}s in {band_text(lo, hi)} so far (open window)",
                      False, evidence)
    if len(series) == 1:
        (i, p), = series.items()
        shown = fmt(p.value) + (f" = {counts[i]}/{n}" if i in counts else "")
        return Result(c, Status.PASS, f"{label}@{i}: {shown} in {_band_text_counts(c)}", True, evidence, p.where)
    worst_lo, worst_hi = min(values.values()), max(values.values())
    return Result(c, Status.PASS, f"{len(series)} {label}s in {band_text(lo, hi)} "
                  f"(min {fmt(worst_lo)}, max {fmt(worst_hi)})", True, evidence)


def _band_text_counts(c: Criterion) -> str:
    text = band_text(c["lo"], c["hi"])
    if c["n"] is None:
        return text
    lo_c, hi_c = c["lo_count"], c["hi_count"]
    counts = (f"{lo_c}–{hi_c}" if lo_c is not None and hi_c is not None else
              f"≥ {lo_c}" if lo_c is not None else f"≤ {hi_c}")
    return f"{counts} of {c['n']} ({text} as printed)"
