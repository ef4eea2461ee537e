"""TensorBoard event files (``events.out.tfevents.*``), read with TensorBoard's own event reader.

The recipe logs its metrics with the step keys ``rollout/step`` and ``eval/step``, both the rollout id by
default, so a scalar's step is taken as the rollout id (for ``eval/*`` tags: the rollout the eval ran after).
TensorBoard holds no memory readings and no resolved config: criteria on those are MISSING for this source.
A directory may hold several event files (a resumed run writes a new one): each is read on its own, in the order it
was written (:func:`event_file_order`), and a later file replaces what earlier ones logged from its first step on
(TensorBoard's own purge of orphaned steps, made independent of how the names sort).
The ``tensorboard`` package is optional; without it this reader raises :class:`ReaderUnavailable` saying so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.readers.errors import ReaderUnavailable
from harness.readers.read_once import ReadOnceSource
from harness.run_data import Point, RunData

__all__ = ["TensorBoardSource", "is_tensorboard", "event_file_order", "EVENT_FILE_GLOB"]

EVENT_FILE_GLOB = "events.out.tfevents.*"


def event_file_order(path: Path) -> tuple:
    """Sort key of ``events.out.tfevents.<seconds>.<host>.<pid>.<n>``: numeric parts compared as numbers. A plain
    name sort puts a writer's 10th file before its 9th, and a resumed attempt's values then lose to the stale
    ones."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.name.split("."))


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
            where_dir = directory.name if directory != self.path else self.path.name
            events: list[tuple[int, int, float, str, float]] = []  # (step, file order, wall_time, tag, value)
            in_dir = sorted((f for f in files if f.parent == directory), key=event_file_order)
            for order, file in enumerate(in_dir):
                mine: list[tuple[int, int, float, str, float]] = []
                # One file at a time, nothing purged: the files' order, not TensorBoard's, decides which value of
                # a re-logged step stands.
                accumulator = event_accumulator.EventAccumulator(
                    str(file), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
                    purge_orphaned_data=False)
                try:
                    accumulator.Reload()
                except Exception as e:  # a corrupt record file: report it, keep the other files
                    run.problem(f"{where_dir}/{file.name}", f"TensorBoard could not read the event file: {e}")
                    continue
                tags = accumulator.Tags()
                for tag in tags.get("scalars", []):
                    mine += [(e.step, order, e.wall_time, tag, e.value) for e in accumulator.Scalars(tag)]
                for tag in tags.get("tensors", []):
                    for e in accumulator.Tensors(tag):
                        array = tensor_util.make_ndarray(e.tensor_proto)
                        if array.size == 1 and array.dtype.kind in "fiu":
                            mine.append((e.step, order, e.wall_time, tag, float(array.reshape(()))))
                if mine:  # a resumed attempt's file: what earlier files logged from its first step on is stale
                    first = min(e[0] for e in mine)
                    events = [e for e in events if e[0] < first] + mine
            # One event per (step): all tags logged at a step arrive together, in step order.
            events.sort(key=lambda x: (x[0], x[1], x[2]))
            last_step = None
            seq = run.seq
            for step, _, wall_time, tag, value in events:
                if step < 0:
                    run.problem(f"{where_dir}:{tag}@{step}", "negative step; skipped")
                    continue
                if step != last_step:
                    seq, last_step = run.begin_event(), step
                if not math.isfinite(value):
                    run.problem(f"{where_dir}:{tag}@{step}", f"non-finite value {value}")
                run.add(Point(tag, step, value, seq, f"{where_dir}:{tag}@{step}", wall_time))
