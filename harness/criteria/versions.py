"""``advances``: the adapter version goes up by ``step`` at every sync, from the saved version after a resume,
and the engine reports the sent version active."""

from __future__ import annotations

from typing import Any

from harness.criteria.criterion import Criterion, Result, Status, not_yet, passed
from harness.run_data import Attempt, RunData


def _version_after_start(run: RunData, attempt: Attempt, step: int) -> tuple[int | None, str]:
    """The version an attempt's first sync must deliver, and why: after a resume at rollout R, the version the
    earlier attempts held after training rollout R − 1 (what the checkpoint saved) + ``step``; after a start
    over without a checkpoint, 1. None when the saved version is not in the run."""
    if attempt.resumed is None or attempt.next_rollout == 0:
        if attempt.resumed is not None and attempt.resumed.next_rollout is None:
            return None, f"{attempt.label} resumed at an unlogged rollout"
        return 1, f"{attempt.label} started over: version 1"
    saved_rollout = attempt.next_rollout - 1
    saved = [s for s in run.syncs if s.attempt < attempt.index and s.rollout_id == saved_rollout
             and s.version is not None]
    if not saved:
        return None, (f"the version saved with rollout {saved_rollout} is not in the run (no sync after training "
                      f"rollout {saved_rollout} before {attempt.label})")
    version: int = saved[-1].version  # type: ignore[assignment]  # None filtered out above
    return version + step, f"the resume at rollout {attempt.next_rollout}: saved version {version} + {step}"


def advances(c: Criterion, run: RunData) -> Result:
    """The sent adapter version goes up by ``step`` at every sync; where logged, the engine reports it active."""
    syncs = [s for s in run.syncs if c.window.contains(s.index)]
    # With ``adapter/engine_version`` among the metrics and logged: the sent versions must advance, and at every
    # sync the engine must report the sent one active (its own answer, so a stuck engine fails here).
    engine = "adapter/engine_version" in c.metrics and any(s.engine_version is not None for s in run.syncs)
    result = _versions_advance(c, run, syncs)
    if engine:
        result.evidence["metric"] = "adapter/engine_version"
    if not engine or result.status is Status.FAIL:
        return result
    for s in syncs:
        if s.engine_version != s.version:
            result.evidence |= {"first_failing_sync": s.index, "engine_version": s.engine_version}
            said = "reports no version" if s.engine_version is None else f"reports version {s.engine_version} active"
            return Result(c, Status.FAIL, f"sync {s.index}: the engine {said}, version {s.version} was sent", True,
                          result.evidence, s.where)
    return result


def _versions_advance(c: Criterion, run: RunData, syncs: list) -> Result:
    step = c["step"]
    versions = [s.version for s in syncs]
    evidence: dict[str, Any] = {"versions": versions, "step": step}
    if any(v is None for v in versions):
        bad = next(s for s in syncs if s.version is None)
        return Result(c, Status.FAIL, f"sync {bad.index} carries no adapter version", True, evidence, bad.where)
    unknown: list[str] = []
    starts: list[str] = []
    for previous, current in zip(syncs, syncs[1:]):
        if current.attempt != previous.attempt and current.attempt < len(run.attempts):
            expected, why = _version_after_start(run, run.attempts[current.attempt], step)
            if expected is None:
                unknown.append(f"sync {current.index}: {why}")
                continue
            starts.append(f"sync {current.index} v{current.version} ({why})")
            if current.version != expected:
                evidence |= {"first_failing_sync": current.index, "expected": expected}
                return Result(c, Status.FAIL, f"sync {current.index}: version {current.version}, expected "
                              f"{expected} ({why})", True, evidence, current.where)
        elif current.version - previous.version != step:  # type: ignore[operator]
            evidence |= {"first_failing_sync": current.index}
            return Result(c, Status.FAIL, f"sync {current.index}: version {current.version} after "
                          f"{previous.version} (expected +{step})", True, evidence, current.where)
    if starts:
        evidence["attempt_starts"] = starts
    if len(syncs) < 2:
        return not_yet(c, run, f"{len(syncs)} sync(s); needs 2", **evidence)
    if unknown:
        evidence["unverified"] = unknown
        return not_yet(c, run, f"{unknown[0]}: that sync's version cannot be checked", **evidence)
    text = f"{len(syncs)} syncs, versions {versions[0]} → {versions[-1]} by +{step}"
    if starts:
        text = (f"{len(syncs)} syncs over {len(starts) + 1} attempts, +{step} within each; after each resume the "
                f"saved version + {step}: " + "; ".join(starts))
    return passed(c, run, text, evidence)
