"""The loop's phases: what each cycle spent its time on, and which phase a run is in now.

**Time per phase.** Cycle N (:mod:`harness.cycles`) is generate N, train N and the sync after it; the colocated
loop also releases and restores memory around training. Each phase's seconds come from a ``perf/*_time`` key
logged for rollout N (docs/RUN_DIRECTORY.md):

=========  ============================  ===========================================================
phase      key                           in the cycle time
=========  ============================  ===========================================================
generate   ``perf/rollout_time``         yes
offload    ``perf/offload_time``         yes (optional: the engines release, the trainer wakes)
train      ``perf/train_time``           yes
onload     ``perf/onload_time``          yes (optional: the trainer sleeps, the engines come back)
sync       ``perf/update_weights_time``  yes
other      —                             yes: the cycle time minus the phases above, when positive
                                         (what the run does not time: our trainer's log-probs, waits)
eval       ``perf/eval_time``            no: the eval after rollout N, drawn on top of cycle N
=========  ============================  ===========================================================

**The phase now** (the rule ``watch`` names a stalled run's phase by). The last event written says what ended
last, so the run is in what comes next:

============================================  ==========================================================
last event                                    phase now
============================================  ==========================================================
``status`` started / resumed                  startup (loading; the startup sync comes next)
``sync`` of no rollout (the startup sync)     eval (before training) when one is due, else generate
``rollout`` N                                 train (rollout N)
``train`` N                                   sync (after rollout N)
``memory`` of an engine's release             offload (rollout N: the engines release, the trainer wakes)
``memory`` of a trainer rank's wake_up        offload (rollout N)
``memory`` of an engine's resume, or of a     onload (rollout N: the trainer sleeps, the engines come back)
trainer rank's sleep (``*_offload``) or
grad-buffer offload
``memory`` (``*_update_weights*``)            sync (the one the reading belongs to; when that sync's own
                                              event came before it, as after that sync)
``sync`` after rollout N                      eval (after rollout N) when one is due, else generate N + 1
``eval`` N                                    generate (rollout N + 1)
``sync`` / ``eval`` of the last rollout        finishing (the save), when no eval is due
``status`` finished / failed                  ended
============================================  ==========================================================

An eval is due after rollout N when the resolved config's ``eval_interval`` divides N + 1 or N + 1 is its
``num_rollout`` (the loop evaluates after the last rollout), and before training unless the resolved config
says ``skip_eval_before_train True`` or the attempt resumed; without ``eval_interval`` the phase says "or eval".
A recipe stdout log has no event kinds: its last line tells instead (a memory reading: sync; a ``LoRA weight
version`` line: generate or eval; an ``eval N`` line: generate; a ``perf N`` / ``step N`` line with
``perf/train_time`` or ``perf/step_time``, or ``train/*`` values: sync; any other ``rollout N`` / ``perf N``
line: train).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.cycles import EVAL_TIME, cycle_times
from harness.run_data import (ENDS, ConfigEntry, EngineMemoryPoint, EventTime, MemoryPoint, Point, RunData,
                              StatusEntry, SyncPoint)

__all__ = ["CYCLE_PHASES", "PHASE_ORDER", "Phase", "cycle_phases", "current_phase"]

# In-cycle phases in loop order, with the key that times each.
CYCLE_PHASES = (
    ("generate", "perf/rollout_time"),
    ("offload", "perf/offload_time"),
    ("train", "perf/train_time"),
    ("onload", "perf/onload_time"),
    ("sync", "perf/update_weights_time"),
)
PHASE_ORDER = tuple(name for name, _ in CYCLE_PHASES) + ("other", "eval")
_TRAINED = ("perf/train_time", "perf/step_time")


def cycle_phases(run: RunData) -> dict[int, dict[str, float]]:
    """``{rollout: {phase: seconds}}`` for every rollout with a timed phase (the module doc's table).

    Only finite durations are kept; ``other`` only when the cycle time is known and exceeds the timed phases.
    """
    cycles = cycle_times(run).cycles
    evals = run.series(EVAL_TIME)
    rollouts = set(cycles) | {i for _, key in CYCLE_PHASES for i in run.series(key)}
    out: dict[int, dict[str, float]] = {}
    for i in sorted(rollouts):
        spent = {name: p.value for name, key in CYCLE_PHASES
                 if (p := run.series(key).get(i)) is not None and math.isfinite(p.value)}
        cycle = cycles.get(i)
        if cycle is not None and math.isfinite(cycle.seconds) and cycle.seconds > sum(spent.values()):
            spent["other"] = cycle.seconds - sum(spent.values())
        if (e := evals.get(i)) is not None and math.isfinite(e.value):
            spent["eval"] = e.value
        if spent:
            out[i] = spent
    return out


@dataclass(frozen=True)
class Phase:
    """What the run is doing now: ``name`` (startup, generate, train, sync, eval, finishing, ended, unknown) and
    which one."""

    name: str
    detail: str  # "rollout 7", "after rollout 6", "" …
    where: str  # the last event, file:line

    def __str__(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name


def current_phase(run: RunData) -> Phase:
    """The phase the run is in, from its last event (the module doc's rule)."""
    records = _last_event(run)
    if not records:
        return Phase("unknown", "nothing logged yet", "-")
    where = records[0].where
    status = next((r for r in records if isinstance(r, StatusEntry)), None)
    if status is not None:
        if status.status in ENDS:
            return Phase("ended", status.status, where)
        return Phase("startup", "loading; the startup sync comes next", where)
    timed = next((r for r in records if isinstance(r, EventTime)), None)
    sync = next((r for r in records if isinstance(r, SyncPoint)), None)
    if sync is not None or (timed is not None and timed.event == "sync"):
        rollout = sync.rollout_id if sync is not None else timed.rollout_id  # type: ignore[union-attr]
        return _after_sync(run, rollout, where)
    engine = next((r for r in records if isinstance(r, EngineMemoryPoint)), None)
    memory = next((r for r in records if isinstance(r, MemoryPoint)), None)
    moving = _memory_move(engine.phase if engine is not None else memory.phase if memory is not None else None,
                          engine is not None)
    if moving is not None:
        rollout = engine.rollout_id if engine is not None else timed.rollout_id if timed is not None else None
        return Phase(moving, f"rollout {rollout}" if rollout is not None else "startup", where)
    if memory is not None or (timed is not None and timed.event == "memory"):
        done = next((s for s in run.syncs if memory is not None and s.index == memory.sync), None)
        if done is not None:  # the reading came after its sync's own event: that sync is over
            return _after_sync(run, done.rollout_id, where)
        rollout = timed.rollout_id if timed is not None else None
        return Phase("sync", "startup" if timed is not None and rollout is None else
                     f"after rollout {rollout}" if rollout is not None else "", where)
    points = [r for r in records if isinstance(r, Point)]
    kind = timed.event if timed is not None else _kind_of(points)
    rollout = timed.rollout_id if timed is not None else (points[0].index if points else None)
    if kind == "eval":
        total = _config_int(run, "num_rollout")
        if rollout is not None and total is not None and rollout + 1 >= total:
            return Phase("finishing", "the save after the last rollout", where)
        return Phase("generate", f"rollout {rollout + 1}" if rollout is not None else "", where)
    if kind == "train":
        return Phase("sync", f"after rollout {rollout}" if rollout is not None else "", where)
    if kind == "rollout":
        return Phase("train", f"rollout {rollout}" if rollout is not None else "", where)
    return Phase("unknown", f"last event: {kind}", where)


# Trainer phases of the memory moves around training (recipe §5.4), by the cycle phase they belong to.
_OFFLOAD_PHASES = ("before_wake_up", "after_wake_up")
_ONLOAD_PHASES = ("before_offload", "after_offload", "before_offload_grad_buffer", "after_offload_grad_buffer")


def _memory_move(phase: str | None, engine: bool) -> str | None:
    """``offload`` / ``onload`` for a reading of the memory moves around training, else None (a sync's reading)."""
    if phase is None:
        return None
    if engine:
        return "offload" if phase.endswith("_release") else "onload" if phase.endswith("_resume") else None
    return "offload" if phase in _OFFLOAD_PHASES else "onload" if phase in _ONLOAD_PHASES else None


def _last_event(run: RunData) -> list:
    """The records of the last event that is not the resolved config."""
    last: list = []
    for record in reversed(run.records):
        if isinstance(record, ConfigEntry):
            continue
        if last and record.seq != last[0].seq:
            break
        last.insert(0, record)
    return last


def _kind_of(points: list[Point]) -> str:
    """The event kind of a recipe log line from its metrics."""
    metrics = {p.metric for p in points}
    if any(m.startswith("eval/") for m in metrics):
        return "eval"
    if metrics & set(_TRAINED) or any(m.startswith("train/") for m in metrics):
        return "train"
    return "rollout"


def _config_int(run: RunData, key: str) -> int | None:
    entry = run.config.get(key)
    try:
        return int(entry.value) if entry is not None else None
    except ValueError:
        return None


def _after_sync(run: RunData, rollout: int | None, where: str) -> Phase:
    interval, total = _config_int(run, "eval_interval"), _config_int(run, "num_rollout")
    if rollout is None:  # the startup sync: the eval before training, then the attempt's first rollout
        first = run.attempts[-1].next_rollout if run.attempts else 0
        skip = run.config.get("skip_eval_before_train")
        resumed = bool(run.attempts) and run.attempts[-1].resumed is not None
        if interval is None:
            return Phase("generate", f"rollout {first}, or the eval before training", where)
        if interval > 0 and not resumed and not (skip is not None and skip.value == "True"):
            return Phase("eval", "before training", where)
        return Phase("generate", f"rollout {first}", where)
    if interval is None:
        return Phase("generate", f"rollout {rollout + 1}, or an eval after rollout {rollout}", where)
    last = total is not None and rollout + 1 >= total
    if interval > 0 and ((rollout + 1) % interval == 0 or last):
        return Phase("eval", f"after rollout {rollout}", where)
    if last:
        return Phase("finishing", "the save after the last rollout", where)
    return Phase("generate", f"rollout {rollout + 1}", where)
