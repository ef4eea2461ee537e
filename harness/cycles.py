"""Rollout cycle time, eval time excluded: logged, or derived from what the run did log.

Cycle N is one turn of the loop that ends with rollout N's weight sync: generate N, train N, sync N. The
recipe also evaluates every 10 rollouts; eval time is not cycle time ("11 to 13 minutes per rollout cycle"
is about the loop), so it is taken out. Three ways to get it, the first one the run supports wins:

1. ``perf/cycle_time`` (seconds, eval already excluded), logged for rollout N — our trainer writes it on the
   ``sync`` event (docs/RUN_DIRECTORY.md).
2. ``perf/step_time`` of rollout N — the recipe's own number (train wait + train time, from the end of train
   N−1 to the end of train N). An eval that ran after rollout N−1 falls inside it: its ``perf/eval_time`` is
   subtracted when logged, otherwise cycle N is left out (and listed as excluded).
3. The times of events: cycle N = time of the sync event of rollout N − time of the previous sync event
   (rollout events when there are no sync events), minus the ``perf/eval_time`` of evals logged in between;
   a cycle holding an eval of unknown duration is left out.

Whatever the rule, a cycle whose training step was profiled, for its time or its memory (``perf/profiled_step`` on
its ``train`` event: ``k3 train --profile-train-step``) is left out too: the profiler's own cost is in its time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.run_data import Point, RunData

__all__ = ["Cycle", "CycleTimes", "cycle_times", "EVAL_TIME", "CYCLE_TIME", "STEP_TIME", "PROFILED_STEP"]

CYCLE_TIME = "perf/cycle_time"
STEP_TIME = "perf/step_time"
EVAL_TIME = "perf/eval_time"
PROFILED_STEP = "perf/profiled_step"


@dataclass(frozen=True)
class Cycle:
    index: int  # the rollout whose sync closes the cycle
    seconds: float  # eval time excluded
    eval_seconds: float  # eval time taken out of it
    seq: int
    where: str


@dataclass
class CycleTimes:
    rule: str  # "perf/cycle_time" | "perf/step_time" | "event times" | "none"
    cycles: dict[int, Cycle] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)  # cycle index -> why it was left out


def cycle_times(run: RunData) -> CycleTimes:
    """The run's cycle times by the first rule it supports, profiled cycles left out (see the module doc)."""
    logged = run.series(CYCLE_TIME)
    if logged:
        out = CycleTimes(CYCLE_TIME)
        for i, p in logged.items():
            out.cycles[i] = Cycle(i, p.value, 0.0, p.seq, p.where)
    elif run.series(STEP_TIME):
        out = _from_step_time(run)
    else:
        out = _from_event_times(run)
    for i, p in run.series(PROFILED_STEP).items():
        if i in out.cycles:
            del out.cycles[i]
            out.excluded[i] = f"its optimizer step {_fmt_step(p.value)} was profiled"
    return out


def _fmt_step(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _eval_points(run: RunData) -> list[Point]:
    """One point per eval (the first eval metric logged for each rollout id), with its time if known."""
    evals: dict[int, Point] = {}
    for metric, series in run.scalars.items():
        if metric.startswith("eval/") and metric != EVAL_TIME:
            for i, p in series.items():
                if i not in evals or p.seq < evals[i].seq:
                    evals[i] = p
    return sorted(evals.values(), key=lambda p: p.seq)


def _from_step_time(run: RunData) -> CycleTimes:
    out = CycleTimes(STEP_TIME)
    steps = run.series(STEP_TIME)
    eval_time = run.series(EVAL_TIME)
    first_step_seq = min(p.seq for p in steps.values())
    # The eval before training (rollout id 0, logged before any step) belongs to cycle 0; an eval after
    # rollout k belongs to cycle k + 1, whose train wait it lengthened.
    eval_cycle: dict[int, list[int]] = {}
    for p in _eval_points(run):
        cycle = 0 if (p.index == 0 and p.seq < first_step_seq) else p.index + 1
        eval_cycle.setdefault(cycle, []).append(p.index)
    for i, p in sorted(steps.items()):
        evals_inside = eval_cycle.get(i, [])
        unknown = [e for e in evals_inside if e not in eval_time]
        if unknown:
            which = "the eval before training" if i == 0 else f"the eval after rollout {unknown[0]}"
            out.excluded[i] = f"holds {which}, whose duration is not logged"
            continue
        spent = sum(eval_time[e].value for e in evals_inside)
        out.cycles[i] = Cycle(i, p.value - spent, spent, p.seq, p.where)
    return out


def _from_event_times(run: RunData) -> CycleTimes:
    syncs = [e for e in run.event_times if e.event == "sync"]
    anchors = syncs if any(e.rollout_id is not None for e in syncs) else [
        e for e in run.event_times if e.event == "rollout"]
    if len(anchors) < 2:
        return CycleTimes("none")
    out = CycleTimes("event times")
    eval_events = [e for e in run.event_times if e.event == "eval"]
    eval_time = run.series(EVAL_TIME)
    anchors = sorted(anchors, key=lambda e: (e.time, e.seq))
    for previous, current in zip(anchors, anchors[1:]):
        if current.rollout_id is None:
            continue
        inside = [e for e in eval_events if previous.time < e.time <= current.time]
        unknown = [e for e in inside if e.rollout_id not in eval_time]
        if unknown:
            out.excluded[current.rollout_id] = (f"holds the eval after rollout {unknown[0].rollout_id}, whose "
                                                "duration is not logged")
            continue
        spent = sum(eval_time[e.rollout_id].value for e in inside)
        out.cycles[current.rollout_id] = Cycle(current.rollout_id, current.time - previous.time - spent, spent,
                                               current.seq, current.where)
    return out
