"""TensorBoard event files (``events.out.tfevents.*``), read with TensorBoard's own event reader.

The recipe logs its metrics with the step keys ``rollout/step`` and ``eval/step``, both the rollout id by
default, so a scalar's step is taken as the rollout id (for ``eval/*`` tags: the rollout the eval ran after).
TensorBoard holds no memory readings and no resolved config: criteria on those are MISSING for this source.
The ``tensorboard`` package is optional; without it this reader raises :class:`ReaderUnavailable` saying so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.readers.errors import ReaderUnavailable
from harness.readers.read_once import ReadOnceSource
from harness.run_data import Point, RunData

__all__ = ["TensorBoardSource", "is_tensorboard", "EVENT_FILE_GLOB"]

EVENT_FILE_GLOB = "events.out.tfevents.*"


def is_tensorboard(path: Path) -> bool:
    if path.is_file():
        return path.name.startswith("events.out.tfevents.")
    return path.is_dir() and next(path.rglob(EVENT_FILE_GLOB), None) is not None


class TensorBoardSource(ReadOnceSource):
    """Reads every event file under a directory (or one file) once; later reads add nothing."""

    kind = "tensorboard"

    def _open(self) -> tuple[Any, Any]:
        try:
            from tensorboard.backend.event_processing import event_accumulator
            from tensorboard.util import tensor_util
        except ImportError as e:
            raise ReaderUnavailable(
                f"{self.path}: reading TensorBoard event files needs the 'tensorboard' package "
                f"(pip install tensorboard): {e}"
            ) from None
        return event_accumulator, tensor_util

    def _read_all(self, run: RunData, opened: tuple[Any, Any]) -> None:
        event_accumulator, tensor_util = opened
        files = [self.path] if self.path.is_file() else sorted(self.path.rglob(EVENT_FILE_GLOB))
        for directory in sorted({f.parent for f in files}):
            accumulator = event_accumulator.EventAccumulator(
                str(directory), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
            try:
                accumulator.Reload()
            except Exception as e:  # a corrupt record file: report it, keep the other directories
                run.problem(str(directory), f"TensorBoard could not read the event files: {e}")
                continue
            where_dir = directory.name if directory != self.path else self.path.name
            tags = accumulator.Tags()
            events: list[tuple[int, float, str, float]] = []  # (step, wall_time, tag, value)
            for tag in tags.get("scalars", []):
                events += [(e.step, e.wall_time, tag, e.value) for e in accumulator.Scalars(tag)]
            for tag in tags.get("tensors", []):
                for e in accumulator.Tensors(tag):
                    array = tensor_util.make_ndarray(e.tensor_proto)
                    if array.size == 1 and array.dtype.kind in "fiu":
                        events.append((e.step, e.wall_time, tag, float(array.reshape(()))))
            # One event per (step): all tags logged at a step arrive together, in step order.
            events.sort(key=lambda x: (x[0], x[1]))
            last_step = None
            seq = run.seq
            for step, wall_time, tag, value in events:
                if step < 0:
                    run.problem(f"{where_dir}:{tag}@{step}", "negative step; skipped")
                    continue
                if step != last_step:
                    seq, last_step = run.begin_event(), step
                if not math.isfinite(value):
                    run.problem(f"{where_dir}:{tag}@{step}", f"non-finite value {value}")
                run.add(Point(tag, step, value, seq, f"{where_dir}:{tag}@{step}", wall_time))
