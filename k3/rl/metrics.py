"""The run directory's event stream: ``metrics.jsonl``, one JSON object per line, append-only, flushed per event.

Schema: docs/RUN_DIRECTORY.md (the harness reads exactly that). Every event carries ``time`` (unix seconds),
``event`` and ``rollout_id``; the other keys use the public recipe's names (``rollout/raw_reward``,
``eval/aime``, ``perf/rollout_time``, ``memory/allocated_gb`` …).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

EVENTS = ("rollout", "train", "eval", "sync", "memory", "status", "replicas")


class MetricsWriter:
    """Append events to ``<run_dir>/metrics.jsonl``; each line is written whole and flushed to disk."""

    def __init__(self, run_dir: str | Path, wandb_run: Any | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._wandb = wandb_run

    def write(self, event: str, rollout_id: int | None, **keys: Any) -> dict[str, Any]:
        if event not in EVENTS:
            raise ValueError(f"event {event!r}: expected one of {EVENTS}")
        rec: dict[str, Any] = {"time": time.time(), "event": event, "rollout_id": rollout_id}
        for k, v in keys.items():
            rec[k] = _plain(v)
        self._f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._wandb is not None:
            nums = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k not in ("time",)}
            self._wandb.log(nums)
        return rec

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _plain(v: Any) -> Any:
    """JSON-safe scalars: tensors to numbers, NaN/inf to None (JSON has no NaN)."""
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
