"""``delivered``: at every sync each engine activated the sent version, every chunk equal to the trained one."""

from __future__ import annotations

from typing import Any

from harness.criteria.criterion import Criterion, Result, Status, not_yet, passed
from harness.run_data import RunData


def delivered(c: Criterion, run: RunData) -> Result:
    """At every sync, each engine reports the sent version active and the trainer's digest for every chunk."""
    syncs = [s for s in run.syncs if c.window.contains(s.index)]
    evidence: dict[str, Any] = {"syncs": len(syncs)}
    judged = 0
    for s in syncs:
        if s.trained_digests is None or not s.engine_digests:
            evidence["without_digests"] = evidence.get("without_digests", 0) + 1
            continue
        judged += 1
        for e in s.engine_digests:
            which = f"engine {e.engine}"
            base = {"first_failing_sync": s.index, "version": s.version, "engine": e.engine}
            if e.version != s.version:
                evidence |= base
                return Result(c, Status.FAIL, f"sync {s.index}: {which} reports version {e.version} active, "
                              f"version {s.version} was sent", True, evidence, s.where)
            for index, digest in enumerate(s.trained_digests):
                got = e.chunks.get(index)
                if got is None:
                    evidence |= base | {"chunk": index, "problem": "missing"}
                    return Result(c, Status.FAIL, f"sync {s.index}: chunk {index} of version {s.version} missing at "
                                  f"{which} ({len(e.chunks)} of {len(s.trained_digests)} chunks activated)", True,
                                  evidence, s.where)
                if got != digest:
                    evidence |= base | {"chunk": index, "problem": "differs", "activated": got, "trained": digest}
                    return Result(c, Status.FAIL, f"sync {s.index}: chunk {index} of version {s.version} differs at "
                                  f"{which}: activated {got[:12]}…, trained {digest[:12]}…", True, evidence, s.where)
            extra = sorted(set(e.chunks) - set(range(len(s.trained_digests))))
            if extra:
                evidence |= base | {"chunk": extra[0], "problem": "never sent"}
                return Result(c, Status.FAIL, f"sync {s.index}: {which} reports chunk {extra[0]} of version "
                              f"{s.version}, which the trainer never sent", True, evidence, s.where)
    evidence["judged"] = judged
    missing = evidence.get("without_digests", 0)
    if judged < c["min_syncs"] or (missing and run.finished):
        return not_yet(c, run, f"{judged} sync(s) with both digests"
                       + (f"; {missing} without" if missing else "") + f"; needs {c['min_syncs']}", **evidence)
    text = f"{judged} syncs: every chunk the engine activated equals the trained one"
    return passed(c, run, text, evidence)
