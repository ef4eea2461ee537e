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

from k3.rl.tensorboard_writer import TENSORBOARD_DIR, TensorBoardWriter, tensorboard_available

EVENTS = ("rollout", "train", "eval", "sync", "memory", "status", "replicas")


class MetricsWriter:
    """Append events to ``<run_dir>/metrics.jsonl``; each line is written whole and flushed to disk.

    ``tensorboard``: also write the rollout metrics as TensorBoard event files under ``<run_dir>/tensorboard``
    (``k3.rl.tensorboard_writer``) when the ``tensorboard`` package is installed."""

    def __init__(self, run_dir: str | Path, wandb_run: Any | None = None, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _end_a_cut_line(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._wandb = wandb_run
        self._tensorboard = (TensorBoardWriter(Path(run_dir) / TENSORBOARD_DIR)
                             if tensorboard and tensorboard_available() else None)

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
        if self._tensorboard is not None:
            self._tensorboard.write(rec)
        return rec

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _end_a_cut_line(path: Path) -> None:
    """A process killed mid-write (``kill -9``) may leave a last line without its ``\\n``; end it, so the next
    attempt's first event starts a line of its own instead of being glued onto the cut one (the harness reports
    the cut line and skips it)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
    with open(path, "ab") as f:
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())


def _plain(v: Any) -> Any:
    """JSON-safe scalars: tensors to numbers, NaN/inf to None (JSON has no NaN)."""
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
