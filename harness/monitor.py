"""The live watch: follow a run as it is written, re-judge it on every new event, abort on the first hard FAIL.

A hard FAIL is a FAIL that no later data can undo (``Result.final``): memory not back after sync k on rank
r, reward out of band at rollout 0, a cycle outside its band. On the first one the watch names the exact
event that decided it (it replays the run event by event over the last batch it read — bisection, since a
final FAIL stays a FAIL on every longer prefix), prints the diagnosis, runs the kill command and stops. A
trend (``no_growth``) can still flatten out, so it fails only when the run is over.

A run that writes nothing for too long by the wall clock has *stalled* (:mod:`harness.stall`: a multiple of
its median cycle, a startup allowance before the first cycle): the watch fails it the same way, naming the
phase it is stuck in (:func:`harness.phases.current_phase`). A source that never says when its run ends (the
recipe's stdout log has no status lines) cannot tell a stuck run from one that ended: there the watch stops
at the limit and judges the log as it stands, as ``check`` would, without the kill command.

The kill command is split with :func:`shlex.split` and run without a shell.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.criteria import Criterion, Result, Status, evaluate_all
from harness.readers import LIVE_KINDS, ReaderError, Source, open_source
from harness.run_data import RunData
from harness.stall import DEFAULT_STALL_RULE, Stall, StallRule, find_stall
from harness.verdict import EXIT_FAIL, EXIT_INCOMPLETE, exit_code

__all__ = ["Watcher", "WatchOutcome", "KillOutcome", "first_failing_event", "run_kill_command", "status_changes"]

KILL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class KillOutcome:
    command: list[str]
    returncode: int | None  # None: it could not be started or timed out
    output: str


@dataclass
class WatchOutcome:
    results: list[Result]  # at the end, or as of the first hard FAIL when there was one
    run: RunData
    exit_code: int
    failed_at: int | None = None  # seq of the event at which the first hard FAIL was decided
    failed_where: str | None = None  # its file:line
    failures: list[Result] = field(default_factory=list)  # the hard FAILs at that event
    kill: KillOutcome | None = None
    timed_out: bool = False
    stall: Stall | None = None  # the run stopped writing events (then exit_code is EXIT_FAIL) …
    quiet_end: bool = False  # … unless the source never says when its run ends: judged as it stands


def first_failing_event(criteria: Sequence[Criterion], run: RunData, lo: int) -> tuple[int, list[Result]]:
    """The smallest event ``seq >= lo`` after which some criterion is a hard FAIL, and those results.

    ``run`` as a whole must have a hard FAIL among ``criteria`` (a final FAIL stays one on longer prefixes,
    so the first failing prefix is found by bisection over ``[lo, last event]``).
    """
    def hard_fails(seq: int) -> list[Result]:
        view = run if seq >= run.events - 1 else run.until(seq)
        return [r for r in evaluate_all(list(criteria), view) if r.hard_fail]

    hi = run.events - 1
    found = {hi: hard_fails(hi)}
    if not found[hi]:
        raise ValueError("first_failing_event needs a run with a hard FAIL")
    lo = max(0, min(lo, hi))
    while lo < hi:
        mid = (lo + hi) // 2
        found[mid] = hard_fails(mid)
        if found[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo, found[lo] if lo in found else hard_fails(lo)


def run_kill_command(command: str) -> KillOutcome:
    """Run ``command`` (split like a shell would, but no shell); never raises."""
    argv = shlex.split(command)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=KILL_TIMEOUT_S, check=False)
    except FileNotFoundError as e:
        return KillOutcome(argv, None, f"could not start: {e}")
    except subprocess.TimeoutExpired as e:
        return KillOutcome(argv, None, f"still running after {KILL_TIMEOUT_S:.0f} s: {e}")
    return KillOutcome(argv, done.returncode, (done.stdout + done.stderr).strip())


class Watcher:
    """Follows the run at ``path`` and judges it with ``criteria`` (see the module doc).

    ``on_update(results, run)`` is called after every evaluation that read new events (for progress output);
    ``on_wait(message)`` while the run does not exist yet. ``clock`` (monotonic) times ``timeout_s``;
    ``wall_clock`` (unix seconds) is what a silence is measured with (``stall``; :mod:`harness.stall`).
    """

    def __init__(
        self,
        path: str | Path,
        criteria: Sequence[Criterion],
        kill_cmd: str | None = None,
        poll_s: float = 5.0,
        timeout_s: float | None = None,
        on_update: Callable[[list[Result], RunData], None] | None = None,
        on_wait: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        stall: StallRule = DEFAULT_STALL_RULE,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll interval must be positive, got {poll_s}")
        self.path = Path(path)
        self.criteria = list(criteria)
        self.kill_cmd = kill_cmd
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.on_update = on_update or (lambda results, run: None)
        self.on_wait = on_wait or (lambda message: None)
        self.clock, self.sleep = clock, sleep
        self.stall, self.wall_clock = stall, wall_clock
        if kill_cmd is not None and not shlex.split(kill_cmd):
            raise ValueError("the kill command is empty")

    def run(self) -> WatchOutcome:
        start = self.clock()
        source = self._wait_for_source(start)
        run = RunData(source=str(self.path), kind=source.kind if source else "")
        if source is None:
            return self._timeout(run)
        live = source.kind in LIVE_KINDS
        first = True
        seen_at: float | None = None  # wall time at which the newest event was first read
        while True:
            checked = run.events
            added = source.read(run, final=not live)
            run.read_at = self.wall_clock()
            if added:
                seen_at = run.read_at
            if not live:
                run.finished = True
            if added or first or run.finished:
                results = evaluate_all(self.criteria, run)
                if any(r.hard_fail for r in results):
                    return self._abort(run, results, lo=checked)
                self.on_update(results, run)
                first = False
            if run.finished:
                source.read(run, final=True)  # a truncated last line is reported now
                results = evaluate_all(self.criteria, run)
                if any(r.hard_fail for r in results):
                    return self._abort(run, results, lo=checked)
                return WatchOutcome(results, run, exit_code(results))
            stall = find_stall(run, self.stall, run.read_at, seen_at) if live else None
            if stall is not None:
                return self._stalled(run, stall)
            if self.timeout_s is not None and self.clock() - start >= self.timeout_s:
                return self._timeout(run)
            self.sleep(self.poll_s)

    def _wait_for_source(self, start: float) -> Source | None:
        announced = False
        while not self.path.exists():
            if not announced:
                self.on_wait(f"{self.path} does not exist yet; waiting for the run to start")
                announced = True
            if self.timeout_s is not None and self.clock() - start >= self.timeout_s:
                return None
            self.sleep(self.poll_s)
        # A run directory may exist before its first file: wait until the reader can tell what it is.
        while True:
            try:
                return open_source(self.path)
            except ReaderError as e:  # nothing readable yet
                if self.timeout_s is not None and self.clock() - start >= self.timeout_s:
                    raise
                if not announced:
                    self.on_wait(f"{e}; waiting")
                    announced = True
                self.sleep(self.poll_s)

    def _abort(self, run: RunData, results: list[Result], lo: int) -> WatchOutcome:
        failing = [r.criterion for r in results if r.hard_fail]
        seq, failures = first_failing_event(failing, run, lo=lo)
        # The verdicts as they stood at that event: what the run looked like when it should have stopped.
        at_failure = evaluate_all(self.criteria, run.until(seq))
        outcome = WatchOutcome(at_failure, run, EXIT_FAIL, failed_at=seq, failed_where=run.where_of(seq),
                               failures=failures)
        if self.kill_cmd is not None:
            outcome.kill = run_kill_command(self.kill_cmd)
        return outcome

    def _stalled(self, run: RunData, stall: Stall) -> WatchOutcome:
        if not run.status:  # no status lines: ended or stuck, the log cannot say
            run.finished = True
            results = evaluate_all(self.criteria, run)
            return WatchOutcome(results, run, exit_code(results), stall=stall, quiet_end=True)
        outcome = WatchOutcome(evaluate_all(self.criteria, run), run, EXIT_FAIL, stall=stall)
        if self.kill_cmd is not None:
            outcome.kill = run_kill_command(self.kill_cmd)
        return outcome

    def _timeout(self, run: RunData) -> WatchOutcome:
        results = evaluate_all(self.criteria, run)
        code = exit_code(results)
        return WatchOutcome(results, run, code if code == EXIT_FAIL else EXIT_INCOMPLETE, timed_out=True)


def status_changes(before: list[Result] | None, after: list[Result]) -> list[tuple[Result, Status | None]]:
    """The results whose status differs from the previous evaluation (with the previous status)."""
    previous = {r.id: r.status for r in before or []}
    return [(r, previous.get(r.id)) for r in after if previous.get(r.id) is not r.status]
