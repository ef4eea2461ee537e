"""``config_equals``: one resolved-config line, as Megatron prints it, equals the spec's value."""

from __future__ import annotations

from harness.criteria.criterion import Criterion, Result, Status, not_yet
from harness.run_data import RunData, config_text


def config_equals(c: Criterion, run: RunData) -> Result:
    """The first of the criterion's config names the run resolved has the spec's value."""
    expected = config_text(c["value"])
    for key in c.metrics:
        entry = run.config.get(key)
        if entry is not None:
            ok = entry.value.strip() == expected
            evidence = {"key": key, "expected": expected, "actual": entry.value}
            text = f"{key} {entry.value}" + ("" if ok else f" (expected {expected})")
            return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence, entry.where)
    return not_yet(c, run, f"{c.metric} not in the resolved config", key=c.metric, expected=expected,
                   config_keys=len(run.config))
