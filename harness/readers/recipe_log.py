"""The public recipe's stdout log (miles ``train.py`` under ``ray job submit``), read line by line.

What it takes from the log (anything before the match — a Ray actor prefix, a logger timestamp — is ignored):

- ``rollout N: {…}``, ``perf N: {…}``, ``eval N: {…}``, ``step N: {…}``: Python dict reprs of the metrics of
  rollout ``N`` (for ``eval``, the rollout the eval ran after; 0 = before training). Parsed as literals
  (:mod:`harness.readers.python_literal`), never executed.
- ``[Rank R] Memory-Usage <phase>: {…, 'allocated_GB': 90.94, …}``: one memory reading of trainer rank R (the
  phase as the run directory names it: ``before offload model`` → ``before_offload``; ``used_GB`` also as
  ``memory/physical_gb``); the k-th reading of a rank at a phase belongs to sync k (the recipe prints no sync
  index; counting per rank is immune to Ray interleaving the ranks' lines, but a reading lost to a garbled line —
  reported — shifts that rank's later ones by one, so that rank lacks the last sync and the memory criteria say
  MISSING). Readings before the log's first ``rollout N`` / ``perf N`` / ``step N`` line are the startup sync's
  (the recipe's first ``update_weights``, adapter version 1, runs before any rollout, so before any optimizer
  step).
- ``LoRA weight version N sent in M chunks``: one adapter sync, after the training of the rollout of the last
  ``rollout N`` / ``perf N`` / ``step N`` line before it (none: the startup sync).
- Megatron's argument dump (``name ..... value`` between ``arguments`` and ``end of arguments``).

A line that looks like one of these but does not parse (a dict cut short, two ranks' writes run together) is
reported with ``file:line`` and skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.readers.argument_dump import parse_dump_line
from harness.readers.follow import Line, LineFollower
from harness.readers.python_literal import LiteralError, parse_dict_literal
from harness.run_data import ConfigEntry, MemoryPoint, Point, RunData, SyncPoint, normalize_phase

__all__ = ["RecipeLogSource", "MEMORY_KEYS"]

DICT_LINE = re.compile(r"(?:^|[\s:\]\)])(rollout|perf|eval|step) (\d+): (\{.*)$")
MEMORY_LINE = re.compile(r"\[Rank (\d+)\] Memory-Usage (.+?)(?: \(cleared before print\))?: (\{.*)$")
RANK_MARKER = re.compile(r"\[Rank (\d+)\]")
SYNC_LINE = re.compile(r"LoRA weight version (\d+) sent in (\d+) chunks")
DUMP_START = re.compile(r"-{3,} arguments -{3,}")
DUMP_END = re.compile(r"-{3,} end of arguments -{3,}")
# print_memory's keys → our metric names (GiB, as the recipe rounds them: 2 decimals). used_GB is the device's
# total − free, what a run directory logs as memory/physical_gb: read under both names.
MEMORY_KEYS = {
    "allocated_GB": ("memory/allocated_gb",),
    "reserved_GB": ("memory/reserved_gb",),
    "used_GB": ("memory/used_gb", "memory/physical_gb"),
    "free_GB": ("memory/free_gb",),
    "total_GB": ("memory/total_gb",),
}
# print_memory's messages whose run-directory phase is not the message with "_" for spaces (docs/RUN_DIRECTORY.md).
PHASES = {
    "before_offload_model": "before_offload",
    "after_offload_model": "after_offload",
    "before_wake_up_model": "before_wake_up",
    "after_wake_up_model": "after_wake_up",
    "after_update_weights_process-group_cleanup": "after_update_weights_cleanup",
}


class RecipeLogSource:
    """Reads a public-recipe stdout log into a :class:`RunData`, incrementally (the log may still grow)."""

    kind = "recipe_log"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lines = LineFollower(self.path)
        self._in_dump = False
        self._memory_count: dict[tuple[int, str], int] = {}  # (rank, phase) -> readings so far
        self._syncs = 0
        self._last_rollout: int | None = None  # of the last rollout / perf / step line: later syncs follow its step

    def read(self, run: RunData, final: bool = False) -> int:
        before = run.events
        for line in self._lines.read(final=final):
            self._read_line(run, line)
        return run.events - before

    def _read_line(self, run: RunData, line: Line) -> None:
        text, where = line.text, f"{self.path.name}:{line.number}"
        suffix = " (the file ends inside this line: truncated)" if line.partial else ""
        if DUMP_START.search(text):
            self._in_dump = True
            return
        if DUMP_END.search(text):
            self._in_dump = False
            return
        if self._in_dump:
            parsed = parse_dump_line(text)
            if parsed is not None:
                run.add(ConfigEntry(parsed[0], parsed[1], run.begin_event(), where))
            return

        markers = list(RANK_MARKER.finditer(text))
        if len(markers) > 1:  # several ranks' writes ran together on one line: judge each piece alone
            ends = [m.start() for m in markers[1:]] + [len(text)]
            for marker, end in zip(markers, ends):
                piece = MEMORY_LINE.match(text, marker.start(), end)
                if piece is None:
                    run.problem(where, f"fragment of rank {marker.group(1)}'s output ({text[marker.start():end][:40]!r}…): "
                                "several ranks' writes ran together on this line; skipped")
                else:
                    self._read_memory(run, where, int(piece.group(1)), normalize_phase(piece.group(2)),
                                      piece.group(3), suffix)
            return
        m = MEMORY_LINE.search(text)
        if m is not None:
            self._read_memory(run, where, int(m.group(1)), normalize_phase(m.group(2)), m.group(3), suffix)
            return
        if "Memory-Usage" in text:
            run.problem(where, f"Memory-Usage line not in the form '[Rank R] Memory-Usage <phase>: {{…}}'{suffix}; "
                        "skipped")
            return

        m = SYNC_LINE.search(text)
        if m is not None:
            seq = run.begin_event()
            run.add(SyncPoint(self._syncs, int(m.group(1)), int(m.group(2)), self._last_rollout, seq, where))
            self._syncs += 1
            return
        if "LoRA weight version" in text:
            run.problem(where, f"LoRA sync line not in the form 'LoRA weight version N sent in M chunks'{suffix}; "
                        "skipped")
            return

        m = DICT_LINE.search(text)
        if m is not None:
            if m.group(1) != "eval":
                self._last_rollout = int(m.group(2))
            self._read_metrics(run, where, int(m.group(2)), m.group(3), m.group(1), suffix)

    def _read_metrics(self, run: RunData, where: str, rollout_id: int, body: str, kind: str, suffix: str) -> None:
        try:
            values = parse_dict_literal(body)
        except LiteralError as e:
            run.problem(where, f"'{kind} {rollout_id}: {{…}}' does not parse: {e}{suffix}; skipped")
            return
        seq = run.begin_event()
        for key, value in values.items():
            if isinstance(key, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
                run.add(Point(key, rollout_id, float(value), seq, where))

    def _read_memory(self, run: RunData, where: str, rank: int, phase: str, body: str, suffix: str) -> None:
        try:
            values = parse_dict_literal(body)
        except LiteralError as e:
            run.problem(where, f"Memory-Usage of rank {rank} does not parse: {e}{suffix}; skipped")
            return
        phase = PHASES.get(phase, phase)
        readings = {name: v for k, v in values.items()
                    if k in MEMORY_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
                    for name in MEMORY_KEYS[k]}
        if not readings:
            run.problem(where, f"Memory-Usage of rank {rank} has none of {', '.join(MEMORY_KEYS)}; skipped")
            return
        sync = self._memory_count.get((rank, phase), 0)
        self._memory_count[(rank, phase)] = sync + 1
        seq = run.begin_event()
        for metric, value in readings.items():
            run.add(MemoryPoint(rank, phase, sync, metric, float(value), seq, where,
                                startup=self._last_rollout is None))
