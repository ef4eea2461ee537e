"""What the harness knows about one run: the records its readers produced, and the views criteria ask for.

Every reader (our run directory, the public recipe's stdout log, TensorBoard, W&B offline) turns its source
into the same records, so a criterion never knows where its numbers came from. Records arrive in *events*
(one ``metrics.jsonl`` line, one log line, one TensorBoard step); each event gets a sequence number ``seq``
(0, 1, 2, …) so :meth:`RunData.until` can replay any prefix of the run — that is how the live watch names the
exact event at which a criterion first failed.

Units: memory in GiB (the recipe's ``allocated_GB`` is ``bytes / 1024**3``), times in seconds (unix time for
timestamps, durations in seconds), rewards and accuracies as fractions in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Problem",
    "Point",
    "MemoryPoint",
    "SyncPoint",
    "ConfigEntry",
    "StatusEntry",
    "EventTime",
    "RunData",
    "normalize_phase",
    "config_text",
]

STATUSES = ("started", "finished", "failed")


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


@dataclass(frozen=True)
class MemoryPoint:
    """One memory reading of one trainer rank at one phase of one weight sync."""

    rank: int
    phase: str  # normalized: "after_update_weights", "before_update_weights", …
    sync: int  # 0-based index of the weight sync (0 = the first one, at startup)
    metric: str  # "memory/allocated_gb", "memory/rss_gb", …
    value: float  # GiB
    seq: int
    where: str


@dataclass(frozen=True)
class SyncPoint:
    """One adapter hand-off from trainer to rollout engine."""

    index: int  # 0-based order of the sync in the run
    version: int | None  # adapter version the engine received
    chunks: int | None
    rollout_id: int | None  # rollout whose training preceded it (None: the startup sync)
    seq: int
    where: str
    time: float | None = None


@dataclass(frozen=True)
class ConfigEntry:
    """One resolved-config value, as text (``True``, ``8``, ``gpu``): the form of Megatron's argument dump."""

    key: str
    value: str
    seq: int
    where: str


@dataclass(frozen=True)
class StatusEntry:
    status: str  # "started" | "finished" | "failed"
    time: float | None
    seq: int
    where: str
    error: str | None = None


@dataclass(frozen=True)
class EventTime:
    """When an event of a kind happened (the anchors cycle time is derived from when it is not logged)."""

    event: str  # "rollout" | "train" | "eval" | "sync" | "memory" | "status"
    rollout_id: int | None
    time: float
    seq: int
    where: str


Record = Point | MemoryPoint | SyncPoint | ConfigEntry | StatusEntry | EventTime


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
    source says the run ended (a ``status`` event ``finished`` or ``failed``); post-hoc sources leave it to
    the caller (:func:`harness.readers.read_run` takes ``finished=``).
    """

    source: str = ""
    kind: str = ""
    records: list[Record] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    events: int = 0  # number of events begun; the current event's seq is events - 1
    finished: bool = False

    # Views, kept up to date by add().
    scalars: dict[str, dict[int, Point]] = field(default_factory=dict)
    memory: dict[tuple[str, str], dict[int, dict[int, MemoryPoint]]] = field(default_factory=dict)
    syncs: list[SyncPoint] = field(default_factory=list)
    config: dict[str, ConfigEntry] = field(default_factory=dict)
    status: list[StatusEntry] = field(default_factory=list)
    event_times: list[EventTime] = field(default_factory=list)

    # --- writing (readers) ---------------------------------------------------------------------------------
    def begin_event(self) -> int:
        """Start a new event; records added until the next call share its ``seq``."""
        self.events += 1
        return self.events - 1

    @property
    def seq(self) -> int:
        return self.events - 1

    def problem(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def add(self, record: Record) -> None:
        """Add a record (its ``seq`` must be the current event's) and update the views.

        A value logged twice for the same place (the same metric of the same rollout, the same rank at the
        same sync) keeps the first and reports the second as a problem: never silently overwritten.
        """
        self.records.append(record)
        if isinstance(record, Point):
            by_index = self.scalars.setdefault(record.metric, {})
            first = by_index.get(record.index)
            if first is not None:
                if first.value != record.value:
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
        elif isinstance(record, SyncPoint):
            self.syncs.append(record)
        elif isinstance(record, ConfigEntry):
            first_cfg = self.config.get(record.key)
            if first_cfg is not None:
                if first_cfg.value != record.value:
                    self.problem(record.where, f"config {record.key} = {record.value!r} differs from "
                                 f"{first_cfg.value!r} at {first_cfg.where}; keeping the first")
                return
            self.config[record.key] = record
        elif isinstance(record, StatusEntry):
            self.status.append(record)
            if record.status in ("finished", "failed"):
                self.finished = True
        elif isinstance(record, EventTime):
            self.event_times.append(record)
        else:  # pragma: no cover - a reader bug
            raise TypeError(f"not a run record: {record!r}")

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
        prefix = RunData(source=self.source, kind=self.kind, problems=list(self.problems))
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
