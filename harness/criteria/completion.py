"""``completes_within``: the run finished, within ``max_minutes`` of run time summed over its attempts, after
at least ``min_rollouts`` rollouts."""

from __future__ import annotations

from typing import Any

from harness.criteria.criterion import Criterion, Result, Status, fmt, not_yet
from harness.run_data import ENDS, RunData


def _attempt_spans(run: RunData) -> tuple[list[tuple[float, float]], str | None]:
    """(start, end) unix seconds of each attempt: from its started (or resumed) status, else its first timed
    event, to its finished / failed status, else its last timed event. Time between attempts (a killed run
    waiting for its resume) is no run time. The second value names a status whose time is not a number."""
    bounds = [a.seq for a in run.attempts] or [0]
    bounds[0] = 0
    spans: list[tuple[float, float]] = []
    for i, attempt in enumerate(run.attempts or [None]):
        lo, hi = bounds[i], bounds[i + 1] if i + 1 < len(bounds) else run.events
        times = [e.time for e in run.event_times if lo <= e.seq < hi]
        statuses = [s for s in run.status if lo <= s.seq < hi]
        for status in statuses:
            if status.status in ("started", *ENDS) and status.time is None:
                return [], f"the {status.status} status ({status.where}) has no valid time"
        start = attempt.start_time if attempt is not None and attempt.start_time is not None else min(
            times, default=None)
        end = attempt.end.time if attempt is not None and attempt.end is not None else max(times, default=None)
        if start is not None and end is not None:
            spans.append((start, end))
    return spans, None


def completes_within(c: Criterion, run: RunData) -> Result:
    """The run finished (not failed) within ``max_minutes`` of run time, after ``min_rollouts`` rollouts."""
    limit_s = c["max_minutes"] * 60.0
    last_status = run.status[-1] if run.status else None
    ended = last_status if last_status is not None and last_status.status in ENDS else None
    rollouts = {e.rollout_id for e in run.event_times if e.event == "rollout"} or {
        i for m, s in run.scalars.items() if m.startswith("rollout/") for i in s}
    evidence: dict[str, Any] = {"max_minutes": c["max_minutes"], "rollouts": len(rollouts),
                                "min_rollouts": c["min_rollouts"], "attempts": max(len(run.attempts), 1)}
    if ended is not None and ended.status == "failed":
        evidence["error"] = ended.error
        return Result(c, Status.FAIL, f"the run failed: {ended.error or 'no error message'}", True, evidence,
                      ended.where)
    spans, broken = _attempt_spans(run)
    if broken is not None:
        evidence["broken"] = broken
        return not_yet(c, run, broken, **evidence)
    if not spans:
        return not_yet(c, run, "no start time (status or timed events)", **evidence)
    elapsed = sum(end - start for start, end in spans)
    evidence["minutes"] = elapsed / 60.0
    earlier = [f"{a.label} {a.end.status}" + (f" ({a.end.error})" if a.end.error else "")
               for a in run.attempts[:-1] if a.end is not None and a.end.status == "failed"]
    resumed = f" over {len(spans)} attempts" if len(spans) > 1 else ""
    if earlier:
        evidence["earlier_failures"] = earlier
        resumed += f" ({'; '.join(earlier)}; resumed)"
    if elapsed > limit_s:
        return Result(c, Status.FAIL, f"{fmt(elapsed / 60, 2)} min > {fmt(c['max_minutes'])} min "
                      f"({len(rollouts)} rollouts){resumed}", True, evidence)
    if ended is None:
        text = f"running for {fmt(elapsed / 60, 2)} min by its events, {len(rollouts)} rollouts{resumed}"
        last = max((e.time for e in run.event_times), default=None)
        if run.read_at is not None and last is not None:
            since = (run.read_at - last) / 60.0
            evidence["minutes_since_last_event"] = since
            text += (f"; last event {fmt(since, 2)} min ago by the clock" if since >= 0 else
                     f"; last event {fmt(-since, 2)} min ahead of this machine's clock")
        return not_yet(c, run, text, **evidence)
    if len(rollouts) < c["min_rollouts"]:
        return Result(c, Status.FAIL, f"finished after {len(rollouts)} rollouts; needs ≥ {c['min_rollouts']}",
                      True, evidence, ended.where)
    return Result(c, Status.PASS, f"finished in {fmt(elapsed / 60, 2)} min ≤ {fmt(c['max_minutes'])} min, "
                  f"{len(rollouts)} rollouts{resumed}", True, evidence, ended.where)
