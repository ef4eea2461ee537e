"""TensorBoard event files beside ``metrics.jsonl``: ``<run_dir>/tensorboard/events.out.tfevents.*``.

The same scalars under the same names as ``metrics.jsonl`` (``rollout/raw_reward``, ``eval/arith``,
``perf/update_weights_time`` …), with the step the rollout id, which is what the harness's TensorBoard reader
(``harness/readers/tensorboard.py``) reads: ``k3-harness check RUN/tensorboard`` judges the same numbers. Only
the metrics of events that belong to a rollout are written (``rollout``, ``train``, ``eval``, ``sync`` with a
``rollout_id``); memory readings and status lines have no rollout step, and the harness reads them from
``metrics.jsonl`` alone. A metric ``metrics.jsonl`` holds as ``null`` (a NaN or inf) is written as NaN.

A resumed attempt opens its writer with ``purge_step`` = its ``next_rollout``, so TensorBoard drops the killed
attempt's values of the rollouts run again (the later attempt wins, as in docs/RUN_DIRECTORY.md). On by default
when the ``tensorboard`` package is installed (it is in the dev extra); without it nothing is written.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_DIR", "TensorBoardWriter", "tensorboard_available"]

TENSORBOARD_DIR = "tensorboard"
_ROLLOUT_EVENTS = ("rollout", "train", "eval", "sync")


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write (it needs the ``tensorboard`` package)."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardWriter:
    """Writes the rollout-step metrics of each event record (``MetricsWriter``'s dicts) into ``log_dir``.

    The event file is opened at the first metric, so a run that fails before any rollout leaves no file, and a
    ``resumed`` status seen before it sets the purge step."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._purge_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        """Take one event record: ``{"time", "event", "rollout_id", ...keys}``."""
        if record.get("event") == "status" and record.get("status") == "resumed" and self._writer is None:
            self._purge_step = int(record["next_rollout"])
            return
        step = record.get("rollout_id")
        if record.get("event") not in _ROLLOUT_EVENTS or not isinstance(step, int):
            return
        scalars = {k: v for k, v in record.items() if "/" in k and _is_metric(v)}
        if not scalars:
            return
        writer = self._open()
        for tag, value in scalars.items():
            writer.add_scalar(tag, math.nan if value is None else float(value), global_step=step,
                              walltime=record.get("time"))
        writer.flush()  # as metrics.jsonl: a live reader sees every event at once

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
        return self._writer


def _is_metric(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
