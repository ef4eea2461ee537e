"""A run directory left by a start that failed before any work: reusable by the corrected command.

The checks of :mod:`k3.launch.preflight` run before anything is written, so most bad starts leave nothing. What
they cannot foresee (Ray failing to start, a checkpoint whose weights do not load, the process killed while the
model loads) leaves ``resolved_config.*`` and a ``metrics.jsonl`` with only status lines. Such a directory holds
no evidence of training, so a fresh ``k3 train`` into it (without ``--resume``: there is nothing to resume) sets
the failed start's event log aside as ``metrics.failed-start-N.jsonl`` and starts there. A directory with an
``adapters/`` folder, or any event besides ``status`` in its ``metrics.jsonl``, is a run and is never reused.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["is_failed_start", "set_aside_failed_start"]

_METRICS = "metrics.jsonl"


def is_failed_start(run_dir: str | Path) -> bool:
    """True when ``run_dir`` holds a ``metrics.jsonl`` of status events only and no ``adapters/``."""
    run_dir = Path(run_dir)
    metrics = run_dir / _METRICS
    if (run_dir / "adapters").exists() or not metrics.is_file():
        return False
    with metrics.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                return False  # not ours to judge: leave it to the user
            if not isinstance(event, dict) or event.get("event") != "status":
                return False
    return True


def set_aside_failed_start(run_dir: str | Path) -> Path:
    """Rename the failed start's ``metrics.jsonl`` to the first free ``metrics.failed-start-N.jsonl``."""
    run_dir = Path(run_dir)
    n = 1
    while (run_dir / f"metrics.failed-start-{n}.jsonl").exists():
        n += 1
    target = run_dir / f"metrics.failed-start-{n}.jsonl"
    (run_dir / _METRICS).rename(target)
    return target
