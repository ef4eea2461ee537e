"""Stalls: a run that writes no new event for too long, by the clock (what ``watch`` fails a silent run on).

A run is *silent* for ``now − t``, where ``t`` is the time of its newest event (its ``time`` field, unix
seconds) or, for a source without event times (a recipe stdout log) or whose newest time is ahead of this
machine's clock, the moment the watch first read that event. It has *stalled* when the silence exceeds its
limit:

- ``multiple`` × the median cycle time (:mod:`harness.cycles`, eval excluded) once the run's current attempt
  has closed a cycle;
- before that (loading, the startup sync, the eval before training, the first cycle's kernel compilation;
  again after every resume) the ``startup_allowance_s``.

The defaults are per tier (a spec's ``[watch]`` table), overridden by ``watch --stall-multiple`` and
``--startup-allowance``. A finished (or failed) run never stalls. What the run is stuck in is named by
:func:`harness.phases.current_phase`. The peer anchor: PrimeIntellect-ai/prime-rl#2142 (a trainer silently
stuck for more than four days); miles' dashboard flags a phase open for more than 6× its median.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from harness.cycles import cycle_times
from harness.phases import Phase, current_phase
from harness.run_data import RunData

__all__ = ["StallRule", "Stall", "DEFAULT_STALL_RULE", "silence_s", "find_stall"]


@dataclass(frozen=True)
class StallRule:
    multiple: float  # of the median cycle time; 0 turns stall detection off
    startup_allowance_s: float  # the limit before the current attempt has closed a cycle

    @property
    def enabled(self) -> bool:
        return self.multiple > 0

    def limit_s(self, run: RunData) -> tuple[float, str]:
        """The silence limit for ``run`` as it is now, and how it was set (for the message)."""
        cycles = [c.seconds for c in cycle_times(run).cycles.values() if math.isfinite(c.seconds) and c.seconds > 0]
        if cycles and _attempt_closed_a_cycle(run):
            median = statistics.median(cycles)
            return self.multiple * median, f"{self.multiple:g} × the median cycle {median / 60:.2f} min"
        return self.startup_allowance_s, (f"the startup allowance {self.startup_allowance_s / 60:g} min: no cycle "
                                          "closed yet" + (" since the resume" if run.attempt > 0 else ""))


DEFAULT_STALL_RULE = StallRule(multiple=3.0, startup_allowance_s=60 * 60.0)


@dataclass(frozen=True)
class Stall:
    silence_s: float
    limit_s: float
    basis: str  # how the limit was set
    phase: Phase  # what the run is stuck in

    def __str__(self) -> str:
        return (f"no new event for {self.silence_s / 60:.1f} min (limit {self.limit_s / 60:.1f} min: {self.basis}); "
                f"last event {self.phase.where}; stuck in {self.phase}")


def _attempt_closed_a_cycle(run: RunData) -> bool:
    """Whether the attempt being read has a sync after training (sources without attempts: any cycle)."""
    if not run.attempts or not any(s.rollout_id is not None for s in run.syncs):
        return True
    return any(s.attempt == run.attempt and s.rollout_id is not None for s in run.syncs)


def silence_s(run: RunData, now: float, seen_at: float | None) -> float | None:
    """Seconds since the run's newest event by the clock (the module doc); None before any event."""
    if run.events == 0:
        return None
    newest = max((e.time for e in run.event_times), default=None)
    if newest is None or newest > now:  # no event times, or the writer's clock runs ahead of ours
        newest = seen_at
    return None if newest is None else now - newest


def find_stall(run: RunData, rule: StallRule, now: float, seen_at: float | None) -> Stall | None:
    """The stall of ``run`` at unix time ``now``, or None (finished, silent for less than the limit, rule off)."""
    if not rule.enabled or run.finished:
        return None
    silence = silence_s(run, now, seen_at)
    if silence is None:
        return None
    limit, basis = rule.limit_s(run)
    if silence <= limit:
        return None
    return Stall(silence, limit, basis, current_phase(run))
