"""Our run directory (docs/RUN_DIRECTORY.md): ``metrics.jsonl`` events and ``resolved_config.{json,txt}``.

Readable while the run is being written: :meth:`RunDirSource.read` picks up whatever was appended since the
last call (byte offset; a partial last line waits for its newline) and the resolved config once it appears.
Every line that cannot be used is reported as a :class:`~harness.run_data.Problem` with ``file:line``.

Across a resume (docs/RUN_DIRECTORY.md, "Resumed runs") sync numbers continue; a writer whose resumed attempt
numbers its syncs from an index the run already used is read on from the next free index (the run's notes say
so), so the readings of every attempt are kept. A memory reading is a *startup* one until its attempt's first ``train``
event (no optimizer step has run, so the optimizer state does not exist yet).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from harness.readers.argument_dump import parse_dump_line
from harness.readers.follow import Line, LineFollower
from harness.run_data import (
    STATUSES,
    ConfigEntry,
    EventTime,
    MemoryPoint,
    EngineChunks,
    Point,
    ReplicaPoint,
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
EVENTS = ("rollout", "train", "eval", "sync", "memory", "status", "replicas")
# Sync keys read into the SyncPoint, not as per-rollout metrics.
SYNC_KEYS = ("adapter/version", "adapter/chunks", "adapter/engine_version")
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
        self._sync_count: dict[tuple[int, str], int] = {}  # (rank, phase) -> next sync of readings without "sync"
        self._next_sync = 0  # sync index of the next sync event without "sync"
        self._attempt = 0  # the attempt the two fields below belong to
        self._offset: int | None = None  # added to the attempt's logged sync numbers; None: not fixed yet
        self._trained = False  # the attempt has a train event: its later syncs follow an optimizer step
        self._last_sync = -1  # highest sync index read so far, every attempt

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
        """The JSON when it parses; else the ``.txt`` dump, with the JSON's fault reported (a corrupt JSON must
        not leave the run without its ``model_variant``: the tier would change)."""
        json_path, txt_path = self.path / CONFIG_JSON, self.path / CONFIG_TXT
        if json_path.exists():
            error = self._read_config_json(run, json_path)
            if error is None:
                self._config_read = True
                return
            if txt_path.exists():
                run.problem(json_path.name, f"{error}; the resolved config is read from {txt_path.name} instead")
            else:
                run.problem(json_path.name, f"{error}; there is no {txt_path.name} to read instead: the resolved "
                            "config is not used")
                run.config_problem = f"{json_path} {error} and there is no {txt_path.name}"
                self._config_read = True
                return
        if txt_path.exists():
            seq = run.begin_event()
            for number, text in enumerate(txt_path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                parsed = parse_dump_line(text)
                if parsed is not None:
                    run.add(ConfigEntry(parsed[0], parsed[1], seq, f"{txt_path.name}:{number}"))
            self._config_read = True

    @staticmethod
    def _read_config_json(run: RunData, json_path: Path) -> str | None:
        """Reads the JSON into ``run``; returns what is wrong with it instead (then nothing was added)."""
        try:
            values = json.loads(json_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"is not valid JSON ({e})"
        if not isinstance(values, dict):
            return f"is not a JSON object of name → value (a {type(values).__name__})"
        seq = run.begin_event()
        for key, value in values.items():
            if key != "env":  # the environment is not an argument
                run.add(ConfigEntry(key, config_text(value), seq, json_path.name))
        return None

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
        kind, rollout_id = event["event"], event.get("rollout_id")
        time: float | None = float(event["time"])
        if not math.isfinite(time):
            run.problem(where, f"'time' is {event['time']!r}, not a time: the event is kept without one")
            time = None
        elif kind != "replicas":  # digests within the train phase: not an anchor of phases or cycle times
            run.add(EventTime(kind, rollout_id, time, seq, where))
        if kind == "status":
            self._read_status(run, event, time, seq, where)
            return
        if kind == "train":
            self._trained = True
        elif kind == "memory":
            self._read_memory(run, event, seq, where)
            return  # memory metrics are per rank, not per rollout
        elif kind == "replicas":
            run.add(ReplicaPoint(event["rank"], event["step"], rollout_id, dict(event["digests"]), seq, where,
                                 run.attempt))
            return  # digests, not metrics
        elif kind == "sync":
            version, chunks = event.get("adapter/version"), event.get("adapter/chunks")
            index = self._sync_index(run, where, event["sync"]) if "sync" in event else self._next_sync
            self._next_sync = index + 1
            self._last_sync = max(self._last_sync, index)
            trained, engines = _delivery(run, where, event)
            run.add(SyncPoint(index, _int_or_none(version), _int_or_none(chunks), rollout_id, seq, where, time,
                              run.attempt, _int_or_none(event.get("adapter/engine_version")), trained, engines))
        if rollout_id is None:
            return
        for key, value in event.items():
            if "/" not in key or key in SYNC_KEYS:
                continue
            number = _metric_value(run, where, key, value)
            if number is not None:
                run.add(Point(key, rollout_id, number, seq, where, time, run.attempt))

    def _read_status(self, run: RunData, event: dict[str, Any], time: float | None, seq: int, where: str) -> None:
        next_rollout = event.get("next_rollout")
        if event["status"] == "resumed" and (not isinstance(next_rollout, int) or isinstance(next_rollout, bool)
                                             or next_rollout < 0):
            run.problem(where, f"a resumed status needs a non-negative integer 'next_rollout', got {next_rollout!r}: "
                        "the rollout it resumed at is unknown")
            next_rollout = None
        checkpoint = event.get("checkpoint")
        run.add(StatusEntry(event["status"], time, seq, where, event.get("error"),
                            checkpoint if isinstance(checkpoint, str) else None, next_rollout))
        if run.attempt != self._attempt:  # a new attempt: its syncs start as startup syncs, its numbering anew
            self._attempt, self._offset, self._trained = run.attempt, None, False

    def _sync_index(self, run: RunData, where: str, logged: int) -> int:
        """The run-wide index of the attempt's logged sync number (the same unless the writer restarted it)."""
        if self._offset is None:
            self._offset = 0
            if self._attempt > 0 and logged <= self._last_sync and run.attempts:
                self._offset = self._last_sync + 1 - logged
                run.attempts[-1].renumbered = (logged, logged + self._offset)  # said in the run's notes
        return logged + self._offset

    def _read_memory(self, run: RunData, event: dict[str, Any], seq: int, where: str) -> None:
        if "engine" in event:
            return  # an engine's reading (docs/RUN_DIRECTORY.md): the trainer criteria read ranks' readings only
        rank, phase = event["rank"], normalize_phase(event["phase"])
        if "sync" in event:
            sync = self._sync_index(run, where, event["sync"])
        else:  # fall back to counting this rank's readings at this phase
            sync = self._sync_count.get((rank, phase), 0)
        self._sync_count[(rank, phase)] = sync + 1
        self._last_sync = max(self._last_sync, sync)
        found = False
        for key, value in event.items():
            if key.startswith("memory/"):
                number = _metric_value(run, where, key, value)
                if number is not None:
                    run.add(MemoryPoint(rank, phase, sync, key, number, seq, where, run.attempt,
                                        startup=not self._trained))
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
    if kind == "status" and event.get("status") not in STATUSES:
        expected = f"{', '.join(STATUSES[:-1])} or {STATUSES[-1]}"
        return f"status event with 'status' {event.get('status')!r} (expected {expected})"
    if kind == "memory":
        if "engine" in event:  # an engine's reading around a release / resume (no rank)
            engine = event["engine"]
            if not isinstance(engine, int) or isinstance(engine, bool) or engine < 0 or "rank" in event:
                return f"an engine's memory event needs a non-negative integer 'engine' and no 'rank', got {engine!r}"
        elif not isinstance(event.get("rank"), int) or isinstance(event.get("rank"), bool):
            return f"memory event needs an integer 'rank', got {event.get('rank')!r}"
        if not isinstance(event.get("phase"), str):
            return f"memory event needs a string 'phase', got {event.get('phase')!r}"
    if kind == "replicas":
        for key in ("rank", "step"):
            value = event.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return f"replicas event needs a non-negative integer {key!r}, got {value!r}"
        digests = event.get("digests")
        if not isinstance(digests, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in digests.items()):
            return f"replicas event needs 'digests': an object of tensor label -> digest string, got {digests!r}"
    if "sync" in event and (not isinstance(event["sync"], int) or isinstance(event["sync"], bool) or event["sync"] < 0):
        return f"'sync' must be a non-negative integer, got {event['sync']!r}"
    return None


def _delivery(run: RunData, where: str, event: dict[str, Any]) -> tuple[tuple[str, ...] | None,
                                                                         tuple[EngineChunks, ...]]:
    """A sync event's ``chunk_digests`` and ``engine_chunk_digests`` (absent: None and ()); a malformed one is
    reported and read as absent, so the ``delivered`` criterion finds it MISSING rather than passing."""
    trained_raw, engines_raw = event.get("chunk_digests"), event.get("engine_chunk_digests")
    trained = None
    if trained_raw is not None:
        if isinstance(trained_raw, list) and all(isinstance(d, str) for d in trained_raw):
            trained = tuple(trained_raw)
        else:
            run.problem(where, f"'chunk_digests' must be a list of digest strings, got {trained_raw!r}; ignored")
    engines: list[EngineChunks] = []
    if engines_raw is not None:
        ok = isinstance(engines_raw, list)
        for entry in engines_raw if ok else []:
            chunks = entry.get("chunks") if isinstance(entry, dict) else None
            if (not isinstance(chunks, dict) or not all(isinstance(k, str) and k.isdigit() and isinstance(v, str)
                                                        for k, v in chunks.items())
                    or not isinstance(entry.get("engine"), int)):
                ok = False
                break
            engines.append(EngineChunks(entry["engine"], _int_or_none(entry.get("version")),
                                        {int(k): v for k, v in chunks.items()}))
        if not ok:
            run.problem(where, "'engine_chunk_digests' must be a list of {\"engine\": int, \"version\": int, "
                        f"\"chunks\": {{\"<index>\": digest}}}}, got {engines_raw!r}; ignored")
            engines = []
    return trained, tuple(engines)


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
