"""Scalar series (rewards, eval accuracies) as band and rise criteria read them: the window's values, a
band's text and test, and an accuracy point's solved count."""

from __future__ import annotations

import math

from harness.criteria.criterion import Criterion, fmt
from harness.run_data import Point, RunData


def scalar_series(c: Criterion, run: RunData) -> tuple[str, dict[int, Point]]:
    """The first of the criterion's metrics the run logged, with its points in the window by index."""
    for metric in c.metrics:
        series = run.series(metric)
        if series:
            return metric, {i: p for i, p in series.items() if c.window.contains(i)}
    return c.metric, {}


def band_text(lo: float | None, hi: float | None) -> str:
    """A band as the summaries print it: ``[lo, hi]``, ``≥ lo`` or ``≤ hi``."""
    if lo is None:
        return f"≤ {fmt(hi)}"  # type: ignore[arg-type]
    if hi is None:
        return f"≥ {fmt(lo)}"
    return f"[{fmt(lo)}, {fmt(hi)}]"


def in_band(x: float, lo: float | None, hi: float | None) -> bool:
    """``x`` is a finite number within [lo, hi] (a bound None is open), to 1e-12."""
    return math.isfinite(x) and (lo is None or x >= lo - 1e-12) and (hi is None or x <= hi + 1e-12)


class BrokenCount(ValueError):
    """A logged solved count (``<metric>/n_correct`` or ``<metric>/n``) that is not a finite number."""


def count_of(run: RunData, metric: str, point: Point, n: int) -> tuple[int | None, str]:
    """Solved count of an accuracy point: logged ``<metric>/n_correct`` when there, else value × n.

    Returns (count or None when it cannot be a count of n, a note); :class:`BrokenCount` when a logged count is
    NaN or infinite (broken evidence fails, it is not worked around).
    """
    logged = run.series(f"{metric}/n_correct").get(point.index)
    logged_n = run.series(f"{metric}/n").get(point.index)
    for name, entry in ((f"{metric}/n", logged_n), (f"{metric}/n_correct", logged)):
        if entry is not None and not math.isfinite(entry.value):
            raise BrokenCount(f"{name} is {entry.value} ({entry.where})")
    if logged_n is not None and int(logged_n.value) != n:
        return None, f"the run logged n = {int(logged_n.value)}, not {n}: judged on the value"
    if logged is not None:
        return int(round(logged.value)), ""
    if not math.isfinite(point.value):
        return None, ""
    k = point.value * n
    if abs(k - round(k)) > 0.02:
        return None, f"{fmt(point.value, 4)} is not a multiple of 1/{n}: judged on the value"
    return int(round(k)), ""


def evals_text(metric: str) -> str:
    """What a metric's points are called in summaries: ``eval`` for ``eval/...``, else ``rollout``."""
    return "eval" if metric.startswith("eval/") else "rollout"
