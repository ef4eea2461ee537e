"""What the harness knows about one run: the records its readers produced, and the views criteria ask for.

Every reader (our run directory, the public recipe's stdout log, TensorBoard, W&B offline) turns its source
into the same records, so a criterion never knows where its numbers came from. Records arrive in *events*
(one ``metrics.jsonl`` line, one log line, one TensorBoard step); each event gets a sequence number ``seq``
(0, 1, 2, …) so :meth:`RunData.until` can replay any prefix of the run — that is how the live watch names the
exact event at which a criterion first failed.

A run may be killed and resumed (``--resume``) any number of times; each stretch of it is an *attempt*
(:class:`Attempt`), begun by a ``started`` status or by a ``resumed`` one after the previous attempt did work
(docs/RUN_DIRECTORY.md, "Resumed runs"). Records carry the attempt they came from. Rollouts that a later attempt
runs again are the later attempt's: when an attempt resumes at rollout R, the earlier attempts' scalars of
rollouts ≥ R leave the views (an attempt that starts over without a ``resumed`` event resumes at 0), and
:meth:`RunData.notes` says so. Memory readings and adapter syncs of every attempt stay: a leak in a killed attempt
is a leak.

Units: memory in GiB (the recipe's ``allocated_GB`` is ``bytes / 1024**3``), times in seconds (unix time for
timestamps, durations in seconds), rewards and accuracies as fractions in [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Problem",
    "Attempt",
    "Point",
    "MemoryPoint",
    "EngineMemoryPoint",
    "SyncPoint",
    "ReplicaPoint",
    "EngineChunks",
    "ConfigEntry",
    "StatusEntry",
    "EventTime",
    "RunData",
    "normalize_phase",
    "config_text",
    "STATUSES",
    "ENDS",
]

STATUSES = ("started", "resumed", "finished", "failed")
ENDS = ("finished", "failed")  # the statuses that end an attempt (and the run, when they are the last)


@dataclass(frozen=True)
class Problem:
    """A line (or file) a reader could not use: reported with its place, then skipped."""

    where: str  # "metrics.jsonl:12", "train.log:4031", "events.out.tfevents.x"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(frozen=True)
class Point:
    """One scalar of one rollout (or eval): ``rollout/raw_reward`` of rollout 3 = 0.62."""

    metric: str
    index: int  # rollout id; for eval metrics the rollout id the eval ran after (0 = before training)
    value: float
    seq: int
    where: str
    time: float | None = None  # unix seconds of the event, when the source has it
    attempt: int = 0  # the attempt that logged it (0 = the first; see the module doc)


@dataclass(frozen=True)
class MemoryPoint:
    """One memory reading of one trainer rank at one phase of one weight sync."""

    rank: int
    phase: str  # normalized: "after_update_weights", "before_update_weights", …
    sync: int  # 0-based index of the weight sync in the run, across attempts (0 = the first one, at startup)
    metric: str  # "memory/allocated_gb", "memory/rss_gb", …
    value: float  # GiB
    seq: int
    where: str
    attempt: int = 0
    # A reading of a startup sync: one before its attempt's first optimizer step, when the optimizer state does
    # not exist yet (so it sits below the level every later sync returns to).
    startup: bool = False


@dataclass(frozen=True)
class EngineMemoryPoint:
    """One memory reading of one rollout engine around its release or resume (recipe §5.1: the engine gives up
    ``tags`` of its memory while the trainer trains, and takes them back for generation).

    ``values`` holds the reading's ``memory/*`` numbers (GiB; ``memory/physical_gb`` is the whole device's use);
    ``weights_resident`` what the engine said of its weights (None: not said)."""

    engine: int
    phase: str  # normalized: "before_release", "after_release", "before_resume", "after_resume"
    sync: int | None  # the sync the reading precedes or belongs to (None: not logged)
    rollout_id: int | None  # None at startup
    tags: tuple[str, ...]  # the memory released or resumed: "weights", "kv_cache", "cuda_graph"
    values: dict[str, float]
    weights_resident: bool | None
    seq: int
    where: str
    attempt: int = 0


@dataclass(frozen=True)
class SyncPoint:
    """One adapter hand-off from trainer to rollout engine."""

    index: int  # 0-based order of the sync in the run, across attempts
    version: int | None  # adapter version the engine received
    chunks: int | None
    rollout_id: int | None  # rollout whose training preceded it (None: the startup sync)
    seq: int
    where: str
    time: float | None = None
    attempt: int = 0
    # The version the engine reported active after the sync (``adapter/engine_version``); None: not logged.
    engine_version: int | None = None
    # Delivered == trained: the trainer's digest of each chunk it sent, in order (None: not logged), and what
    # each engine reported it activated.
    trained_digests: tuple[str, ...] | None = None
    engine_digests: tuple["EngineChunks", ...] = ()


@dataclass(frozen=True)
class EngineChunks:
    """What one rollout engine reported after a sync: its active version and a digest per chunk it activated."""

    engine: int
    version: int | None
    chunks: dict[int, str]  # chunk index -> digest


@dataclass(frozen=True)
class ReplicaPoint:
    """One trainer rank's digests of the adapter tensors it holds, after optimizer step ``step``.

    Ranks that hold replicas of one tensor log it under the same label (docs/RUN_DIRECTORY.md, ``replicas``)."""

    rank: int
    step: int
    rollout_id: int | None
    digests: dict[str, str]  # label -> digest
    seq: int
    where: str
    attempt: int = 0


@dataclass(frozen=True)
class ConfigEntry:
    """One resolved-config value, as text (``True``, ``8``, ``gpu``): the form of Megatron's argument dump."""

    key: str
    value: str
    seq: int
    where: str


@dataclass(frozen=True)
class StatusEntry:
    status: str  # "started" | "resumed" | "finished" | "failed"
    time: float | None  # None: the event's time was not a finite number (reported by the reader)
    seq: int
    where: str
    error: str | None = None
    checkpoint: str | None = None  # resumed: the checkpoint it loaded
    next_rollout: int | None = None  # resumed: the first rollout it runs (None: not logged)


@dataclass
class Attempt:
    """One stretch of a run between a start (or resume) and its end, a kill, or the next resume."""

    index: int  # 0, 1, …
    seq: int  # the event that began it
    where: str
    start_time: float | None = None  # its started (else resumed) status's time
    resumed: StatusEntry | None = None  # its resumed status, when it continued from a checkpoint
    end: StatusEntry | None = None  # its finished / failed status; None: killed, or still running
    replaced: set[int] = field(default_factory=set)  # rollout ids whose earlier-attempt scalars it superseded
    started: bool = False  # it has a started status
    # (logged, read as): the attempt numbered its syncs from an index the run had used; read on from a free one
    renumbered: tuple[int, int] | None = None
    has_work: bool = False  # any rollout, train, eval, sync or memory record yet

    @property
    def next_rollout(self) -> int:
        """The first rollout it runs: the resumed status's, 0 when it started over (or is the first)."""
        if self.resumed is not None and self.resumed.next_rollout is not None:
            return self.resumed.next_rollout
        return 0

    @property
    def label(self) -> str:
        """"attempt 2" (1-based, as a user counts them)."""
        return f"attempt {self.index + 1}"


@dataclass(frozen=True)
class EventTime:
    """When an event of a kind happened (the anchors cycle time is derived from when it is not logged)."""

    event: str  # "rollout" | "train" | "eval" | "sync" | "memory" | "status"
    rollout_id: int | None
    time: float
    seq: int
    where: str


Record = Point | MemoryPoint | EngineMemoryPoint | SyncPoint | ReplicaPoint | ConfigEntry | StatusEntry | EventTime


def normalize_phase(phase: str) -> str:
    """``"after update_weights"`` → ``"after_update_weights"``: the recipe's print_memory message as a key."""
    return "_".join(phase.strip().lower().split())


def config_text(value: Any) -> str:
    """A config value as Megatron's dump prints it: ``True``, ``8`` (also for 8.0), ``gpu``, ``None``."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return str(list(value))
    return str(value)


@dataclass
class RunData:
    """All records of one run, in arrival order, plus indexed views of them.

    ``source`` names what was read (a directory or file), ``kind`` the reader. ``finished`` is set when the
    source says the run ended (a ``status`` event ``finished`` or ``failed``; a later ``started`` or
    ``resumed`` makes it running again); post-hoc sources leave it to the caller
    (:func:`harness.readers.read_run` takes ``finished=``).
    """

    source: str = ""
    kind: str = ""
    records: list[Record] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    events: int = 0  # number of events begun; the current event's seq is events - 1
    finished: bool = False
    read_at: float | None = None  # unix seconds of the last read (the clock "time since the last event" uses)
    # Set when a resolved config exists but could not be read (the tier must then not be guessed from it).
    config_problem: str | None = None

    # Views, kept up to date by add().
    scalars: dict[str, dict[int, Point]] = field(default_factory=dict)
    memory: dict[tuple[str, str], dict[int, dict[int, MemoryPoint]]] = field(default_factory=dict)
    engine_memory: list[EngineMemoryPoint] = field(default_factory=list)  # in arrival order
    syncs: list[SyncPoint] = field(default_factory=list)
    # (attempt, step) -> rank -> digests; steps restart with a resumed attempt's optimizer state, so the attempt
    # is part of the key
    replicas: dict[tuple[int, int], dict[int, ReplicaPoint]] = field(default_factory=dict)
    config: dict[str, ConfigEntry] = field(default_factory=dict)
    status: list[StatusEntry] = field(default_factory=list)
    event_times: list[EventTime] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    # --- writing (readers) ---------------------------------------------------------------------------------
    def begin_event(self) -> int:
        """Start a new event; records added until the next call share its ``seq``."""
        self.events += 1
        return self.events - 1

    @property
    def seq(self) -> int:
        return self.events - 1

    @property
    def attempt(self) -> int:
        """The index of the attempt now being read (0 before any status)."""
        return len(self.attempts) - 1 if self.attempts else 0

    def problem(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def add(self, record: Record) -> None:
        """Add a record (its ``seq`` must be the current event's) and update the views.

        A value logged twice for the same place (the same metric of the same rollout, the same rank at the
        same sync) in one attempt keeps the first and reports the second as a problem: never silently
        overwritten. A later attempt's value of a rollout replaces an earlier attempt's (the module doc).
        """
        self.records.append(record)
        if isinstance(record, StatusEntry):
            self._add_status(record)
            return
        if isinstance(record, (Point, MemoryPoint, EngineMemoryPoint, SyncPoint, ReplicaPoint)) or (
                isinstance(record, EventTime) and record.event != "status"):
            self._note_work()
        if isinstance(record, Point):
            by_index = self.scalars.setdefault(record.metric, {})
            first = by_index.get(record.index)
            if first is not None and record.attempt > first.attempt:
                self._current().replaced.add(record.index)
            elif first is not None:
                if not _same_value(first.value, record.value):
                    self.problem(record.where, f"{record.metric} of rollout {record.index} logged again "
                                 f"({record.value!r}; first {first.value!r} at {first.where}); keeping the first")
                return
            by_index[record.index] = record
        elif isinstance(record, MemoryPoint):
            by_rank = self.memory.setdefault((record.phase, record.metric), {}).setdefault(record.rank, {})
            first_mem = by_rank.get(record.sync)
            if first_mem is not None:
                self.problem(record.where, f"{record.metric} of rank {record.rank} at {record.phase} of sync "
                             f"{record.sync} logged again; keeping the first ({first_mem.where})")
                return
            by_rank[record.sync] = record
        elif isinstance(record, EngineMemoryPoint):
            self.engine_memory.append(record)
        elif isinstance(record, SyncPoint):
            self.syncs.append(record)
        elif isinstance(record, ReplicaPoint):
            by_rank = self.replicas.setdefault((record.attempt, record.step), {})
            first_rep = by_rank.get(record.rank)
            if first_rep is not None:
                self.problem(record.where, f"replica digests of rank {record.rank} at step {record.step} logged again; "
                             f"keeping the first ({first_rep.where})")
                return
            by_rank[record.rank] = record
        elif isinstance(record, ConfigEntry):
            first_cfg = self.config.get(record.key)
            if first_cfg is not None:
                if first_cfg.value != record.value:
                    self.problem(record.where, f"config {record.key} = {record.value!r} differs from "
                                 f"{first_cfg.value!r} at {first_cfg.where}; keeping the first")
                return
            self.config[record.key] = record
        elif isinstance(record, EventTime):
            self.event_times.append(record)
        else:  # pragma: no cover - a reader bug
            raise TypeError(f"not a run record: {record!r}")

    def _current(self) -> Attempt:
        if not self.attempts:
            self.attempts.append(Attempt(0, 0, "start of the run"))
        return self.attempts[-1]

    def _add_status(self, entry: StatusEntry) -> None:
        """Attempts: a ``started`` status begins one unless the current attempt has nothing in it yet; a
        ``resumed`` status begins one when the current attempt already did work or ended, else it marks the
        current one (begun by its ``started``) as resumed."""
        self.status.append(entry)
        current = self.attempts[-1] if self.attempts else None
        if entry.status in ("started", "resumed"):
            used = current is not None and (current.has_work or current.resumed is not None or current.end is not None
                                            or (entry.status == "started" and current.started))
            if current is None or used:
                current = Attempt(len(self.attempts), entry.seq, entry.where)
                self.attempts.append(current)
            if current.start_time is None:
                current.start_time = entry.time
            if entry.status == "started":
                current.started = True
            else:
                current.resumed = entry
                self._supersede(current, entry.next_rollout)
            self.finished = False
        elif entry.status in ENDS:
            self._current().end = entry
            self.finished = True

    def _note_work(self) -> None:
        current = self._current()
        if not current.has_work:
            current.has_work = True
            if current.index > 0 and current.resumed is None:
                self._supersede(current, 0)  # started over without a checkpoint: from rollout 0

    def _supersede(self, attempt: Attempt, next_rollout: int | None) -> None:
        """Earlier attempts' scalars of rollouts >= next_rollout leave the views: ``attempt`` runs them again."""
        if next_rollout is None or attempt.index == 0:
            return
        for series in self.scalars.values():
            for index in [i for i, p in series.items() if i >= next_rollout and p.attempt < attempt.index]:
                del series[index]
                attempt.replaced.add(index)

    def notes(self) -> list[str]:
        """What the harness did with attempts: one line per attempt after the first (empty for one attempt)."""
        out = []
        for a in self.attempts[1:]:
            previous = self.attempts[a.index - 1]
            how = (f"resumed from {a.resumed.checkpoint or 'a checkpoint'} at rollout {a.next_rollout}"
                   if a.resumed is not None else "started over from rollout 0 (no resumed event)")
            ended = (f"{previous.end.status}" if previous.end is not None else
                     "ended without a finished or failed status (killed)")
            line = f"{a.label} ({a.where}) {how} after {previous.label} {ended}"
            if a.renumbered is not None:
                line += (f"; it numbered its syncs from {a.renumbered[0]} again, read as syncs {a.renumbered[1]}… "
                         "(sync numbers continue across a resume, docs/RUN_DIRECTORY.md)")
            if a.replaced:
                line += (f"; rollouts {_ranges(sorted(a.replaced))} of earlier attempts are superseded by "
                         f"{a.label}'s (the later attempt wins)")
            out.append(line + "; memory readings and syncs of every attempt are judged")
        return out

    # --- reading (criteria) --------------------------------------------------------------------------------
    def series(self, metric: str) -> dict[int, Point]:
        """``{index: Point}`` of a scalar metric (empty when never logged)."""
        return self.scalars.get(metric, {})

    def memory_series(self, phase: str, metric: str) -> dict[int, dict[int, MemoryPoint]]:
        """``{rank: {sync: MemoryPoint}}`` of one memory metric at one phase."""
        return self.memory.get((normalize_phase(phase), metric), {})

    def memory_metrics(self) -> set[str]:
        return {metric for _, metric in self.memory}

    def until(self, seq: int) -> "RunData":
        """The run as it was after event ``seq`` (records of later events left out; problems kept)."""
        prefix = RunData(source=self.source, kind=self.kind, problems=list(self.problems), read_at=self.read_at,
                         config_problem=self.config_problem)
        prefix.events = min(self.events, seq + 1)
        for record in self.records:
            if record.seq > seq:
                break
            prefix.add(record)
        prefix.problems = list(self.problems)  # add() may have re-reported duplicates
        return prefix

    def where_of(self, seq: int) -> str:
        """The place of the first record of event ``seq`` ("metrics.jsonl:57"), or ``event #seq``."""
        for record in self.records:
            if record.seq == seq:
                return record.where
            if record.seq > seq:
                break
        return f"event #{seq}"


def _same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _ranges(indices: list[int]) -> str:
    """``[5, 6, 7, 9]`` → ``"5–7, 9"``."""
    parts: list[str] = []
    start = prev = None
    for i in indices + [None]:  # type: ignore[list-item]
        if start is not None and (i is None or i != prev + 1):
            parts.append(str(start) if start == prev else f"{start}–{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(parts)
