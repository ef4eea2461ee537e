"""Our run directory (docs/RUN_DIRECTORY.md): ``metrics.jsonl`` events and ``resolved_config.{json,txt}``.

Readable while the run is being written: :meth:`RunDirSource.read` picks up whatever was appended since the
last call (byte offset; a partial last line waits for its newline) and the resolved config once it appears.
Every line that cannot be used is reported as a :class:`~harness.run_data.Problem` with ``file:line``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from harness.readers.argument_dump import parse_dump_line
from harness.readers.follow import Line, LineFollower
from harness.run_data import (
    ConfigEntry,
    EventTime,
    MemoryPoint,
    Point,
    RunData,
    StatusEntry,
    SyncPoint,
    config_text,
    normalize_phase,
)

__all__ = ["RunDirSource", "METRICS_NAME", "CONFIG_JSON", "CONFIG_TXT", "EVENTS", "is_run_dir"]

METRICS_NAME = "metrics.jsonl"
CONFIG_JSON = "resolved_config.json"
CONFIG_TXT = "resolved_config.txt"
EVENTS = ("rollout", "train", "eval", "sync", "memory", "status")
# Keys without a "/" are the event's structure; keys with one ("rollout/raw_reward") are its metrics.
STRUCTURE_KEYS = {"time", "event", "rollout_id", "rank", "phase", "sync", "status", "error"}


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in (METRICS_NAME, CONFIG_JSON, CONFIG_TXT))


class RunDirSource:
    """Reads a ``k3 train`` run directory into a :class:`RunData`, incrementally."""

    kind = "run_dir"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._metrics = LineFollower(self.path / METRICS_NAME)
        self._config_read = False
        self._sync_count: dict[tuple[int, str], int] = {}  # (rank, phase) -> memory events seen without "sync"
        self._next_sync = 0

    def read(self, run: RunData, final: bool = False) -> int:
        """Add what is new to ``run``; returns the number of events added."""
        before = run.events
        if not self._config_read:
            self._read_config(run)
        for line in self._metrics.read(final=final):
            self._read_line(run, line)
        return run.events - before

    # --- resolved config -----------------------------------------------------------------------------------
    def _read_config(self, run: RunData) -> None:
        json_path, txt_path = self.path / CONFIG_JSON, self.path / CONFIG_TXT
        if json_path.exists():
            where = json_path.name
            try:
                values = json.loads(json_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                run.problem(where, f"not valid JSON ({e}); the resolved config is not used")
                self._config_read = True
                return
            if not isinstance(values, dict):
                run.problem(where, f"expected a JSON object of name → value, got {type(values).__name__}")
                self._config_read = True
                return
            seq = run.begin_event()
            for key, value in values.items():
                if key != "env":  # the environment is not an argument
                    run.add(ConfigEntry(key, config_text(value), seq, where))
            self._config_read = True
        elif txt_path.exists():
            seq = run.begin_event()
            for number, text in enumerate(txt_path.read_text(encoding="utf-8").splitlines(), 1):
                parsed = parse_dump_line(text)
                if parsed is not None:
                    run.add(ConfigEntry(parsed[0], parsed[1], seq, f"{txt_path.name}:{number}"))
            self._config_read = True

    # --- metrics.jsonl -------------------------------------------------------------------------------------
    def _read_line(self, run: RunData, line: Line) -> None:
        where = f"{METRICS_NAME}:{line.number}"
        if not line.text.strip():
            return
        try:
            event = json.loads(line.text)
        except json.JSONDecodeError as e:
            kind = "truncated line (no newline at the end of the finished file)" if line.partial else "not JSON"
            # json's "Unterminated string starting at" already ends in "at": not "at at column"
            run.problem(where, f"{kind}: {e.msg.removesuffix(' at')} at column {e.colno}; skipped")
            return
        if not isinstance(event, dict):
            run.problem(where, f"expected a JSON object, got {type(event).__name__}; skipped")
            return
        error = _structure_error(event)
        if error:
            run.problem(where, f"{error}; skipped")
            return
        seq = run.begin_event()
        kind, rollout_id, time = event["event"], event.get("rollout_id"), float(event["time"])
        run.add(EventTime(kind, rollout_id, time, seq, where))
        if kind == "status":
            run.add(StatusEntry(event["status"], time, seq, where, event.get("error")))
        elif kind == "memory":
            self._read_memory(run, event, seq, where)
            return  # memory metrics are per rank, not per rollout
        elif kind == "sync":
            version, chunks = event.get("adapter/version"), event.get("adapter/chunks")
            index = event.get("sync", self._next_sync)
            self._next_sync = index + 1
            run.add(SyncPoint(index, _int_or_none(version), _int_or_none(chunks), rollout_id, seq, where, time))
        if rollout_id is None:
            return
        for key, value in event.items():
            if "/" not in key or key in ("adapter/version", "adapter/chunks"):
                continue
            number = _metric_value(run, where, key, value)
            if number is not None:
                run.add(Point(key, rollout_id, number, seq, where, time))

    def _read_memory(self, run: RunData, event: dict[str, Any], seq: int, where: str) -> None:
        rank, phase = event["rank"], normalize_phase(event["phase"])
        sync = event.get("sync")
        if sync is None:  # fall back to counting this rank's readings at this phase
            sync = self._sync_count.get((rank, phase), 0)
        self._sync_count[(rank, phase)] = sync + 1
        found = False
        for key, value in event.items():
            if key.startswith("memory/"):
                number = _metric_value(run, where, key, value)
                if number is not None:
                    run.add(MemoryPoint(rank, phase, sync, key, number, seq, where))
                    found = True
        if not found:
            run.problem(where, "memory event without any memory/* value")


def _structure_error(event: dict[str, Any]) -> str | None:
    """What is wrong with the structural keys of an event, or None."""
    for key in ("time", "event"):
        if key not in event:
            return f"missing {key!r}"
    if not _is_number(event["time"]):
        return f"'time' must be unix seconds, got {event['time']!r}"
    kind = event["event"]
    if kind not in EVENTS:
        return f"unknown event {kind!r} (expected one of {', '.join(EVENTS)})"
    rollout_id = event.get("rollout_id")
    if rollout_id is not None and (not isinstance(rollout_id, int) or isinstance(rollout_id, bool) or rollout_id < 0):
        return f"'rollout_id' must be a non-negative integer or null, got {rollout_id!r}"
    if kind in ("rollout", "train", "eval") and rollout_id is None:
        return f"a {kind} event needs an integer 'rollout_id'"
    if kind == "status" and event.get("status") not in ("started", "finished", "failed"):
        return f"status event with 'status' {event.get('status')!r} (expected started, finished or failed)"
    if kind == "memory":
        if not isinstance(event.get("rank"), int) or isinstance(event.get("rank"), bool):
            return f"memory event needs an integer 'rank', got {event.get('rank')!r}"
        if not isinstance(event.get("phase"), str):
            return f"memory event needs a string 'phase', got {event.get('phase')!r}"
    if "sync" in event and (not isinstance(event["sync"], int) or isinstance(event["sync"], bool) or event["sync"] < 0):
        return f"'sync' must be a non-negative integer, got {event['sync']!r}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _metric_value(run: RunData, where: str, key: str, value: Any) -> float | None:
    """A metric's number; ``null`` (how the writer stores NaN/inf) becomes NaN, so criteria see it and fail."""
    if value is None:
        run.problem(where, f"{key} is null (non-finite when written); counted as NaN")
        return math.nan
    if _is_number(value):
        return float(value)
    return None  # text or nested values are context, not metrics
