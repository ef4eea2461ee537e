"""``cycle_time_within``: every rollout cycle's time in [lo, hi] (cycles as :mod:`harness.cycles` cuts
them), up to ``allowed_outside`` of them outside."""

from __future__ import annotations

import statistics
from typing import Any

from harness.criteria.criterion import Criterion, Result, SpecError, Status, fmt, not_yet, passed
from harness.criteria.params import check_positive
from harness.criteria.scalars import in_band
from harness.cycles import cycle_times
from harness.run_data import RunData


def check_cycle(c: Criterion) -> None:
    """The spec's cycle band is one: lo ≤ hi, neither it nor ``allowed_outside`` negative."""
    if c["lo"] > c["hi"]:
        raise SpecError(f"{c.where}: 'lo' {c['lo']} is above 'hi' {c['hi']}")
    check_positive("lo", "allowed_outside")(c)


def cycle_time_within(c: Criterion, run: RunData) -> Result:
    """Every cycle time of the window (seconds or minutes, by ``unit``) in [lo, hi], but ``allowed_outside``."""
    scale = 60.0 if c["unit"] == "min" else 1.0
    unit = c["unit"]
    lo, hi = c["lo"], c["hi"]
    times = cycle_times(run)
    cycles = {i: cyc for i, cyc in sorted(times.cycles.items()) if c.window.contains(i)}
    excluded = {i: why for i, why in times.excluded.items() if c.window.contains(i)}
    values = {i: cyc.seconds / scale for i, cyc in cycles.items()}
    evidence: dict[str, Any] = {"rule": times.rule, "unit": unit, "window": str(c.window), "values": values,
                                "excluded": excluded,
                                "eval_excluded": {i: cyc.eval_seconds / scale for i, cyc in cycles.items()
                                                  if cyc.eval_seconds}}
    if not cycles:
        return not_yet(c, run, f"no cycle times in {c.window} (rule: {times.rule})", **evidence)
    ordered = list(values.values())
    median = statistics.median(ordered)
    slowest = max(values, key=lambda i: values[i])
    fastest = min(values, key=lambda i: values[i])
    evidence |= {"median": median, "worst": values[slowest], "worst_cycle": slowest,
                 "fastest": values[fastest], "fastest_cycle": fastest}
    outside = [i for i in values if not in_band(values[i], lo, hi)]
    evidence["outside"] = outside
    stats = (f"median {fmt(median, 2)} {unit}, worst {fmt(values[slowest], 2)} {unit} (cycle {slowest}), "
             f"fastest {fmt(values[fastest], 2)}")
    if len(outside) > c["allowed_outside"]:
        i = outside[c["allowed_outside"]]
        evidence["first_failing_cycle"] = i
        return Result(c, Status.FAIL, f"cycle {i}: {fmt(values[i], 2)} {unit} outside "
                      f"[{fmt(lo)}, {fmt(hi)}] {unit}; {stats}", True, evidence, cycles[i].where)
    absent = [i for i in c.window.required() if i not in cycles and i not in excluded]
    if absent:
        return not_yet(c, run, f"no cycle time for cycle(s) {', '.join(map(str, absent[:5]))}", **evidence)
    text = f"{len(values)} cycles in [{fmt(lo)}, {fmt(hi)}] {unit}: {stats}"
    if excluded:
        text += f"; left out: {'; '.join(f'cycle {i} {why}' for i, why in sorted(excluded.items()))}"
    return passed(c, run, text, evidence)
