"""Criteria: what one recipe sentence demands of a run, and its verdict on a run's data.

A :class:`Criterion` is one ``[[criterion]]`` table of a tier spec (``harness/spec/*.toml``); its ``kind``
says how it is judged. Kinds and their parameters (besides the common ``id``, ``kind``, ``metric``, ``doc``,
``window``, ``profile``):

====================  ===============================================================================
kind                  parameters
====================  ===============================================================================
band                  ``lo``, ``hi`` (either may be left out), ``reduce`` = each | mean, ``n`` with
                      ``lo_count`` / ``hi_count`` (judge as solved counts of ``n``)
rise_by               ``min_rise``; ``n`` with ``min_rise_count``; window = [from, to] (to −1: the last)
returns_to_baseline   ``tolerance_gb``, ``phase``, ``side`` = both | above, ``baseline_gb`` (absolute),
                      ``min_syncs``; per rank, per sync; baseline = the rank's first reading in the window
                      after its attempt's first optimizer step; startup syncs (before it) only not above
no_growth             ``max_slope_gb_per_sync``, ``phase``, ``min_points``; least-squares slope per rank of
                      the readings after training, each relative to its attempt's baseline
config_equals         ``value``: the resolved value of the config name in ``metric``, as Megatron prints it
cycle_time_within     ``lo``, ``hi``, ``unit`` = s | min, ``allowed_outside``; see :mod:`harness.cycles`
completes_within      ``max_minutes``, ``min_rollouts``: from the ``started`` to the ``finished`` status,
                      summed over attempts (a resumed run's downtime is not run time)
advances              ``step``: the adapter version goes up by exactly ``step`` at every sync; an
                      attempt's first sync delivers the saved version + ``step`` after a resume (1 after
                      a start over). ``metric`` ``adapter/engine_version``: the version the engine
                      reported active (else ``adapter/version``, the one the trainer sent)
replicas_agree        ``min_steps``: after every optimizer step, every replica of an adapter tensor (same
                      label on several ranks) has the same digest; FAIL names the first step, the tensor
                      and the ranks on each side
delivered             ``min_syncs``: at every sync each engine reports the sent version active and, for
                      every chunk the trainer sent, the trainer's digest; FAIL names the sync, version,
                      chunk and engine
resident_while_asleep ``max_gb``, ``before_phase`` / ``after_phase`` (the trainer's sleep), ``min_syncs``;
                      per rank and sleep: what its allocator held before (reserved, else allocated) minus
                      what left the device (``metric``: physical, the whole device) ≤ ``max_gb``
released_while_training  ``tag`` (weights), ``min_released_gb``, ``min_rollouts``; per engine and trained
                      rollout: an ``after_release`` of ``tag`` before the train event, no resume before it,
                      and ≥ ``min_released_gb`` of ``metric`` freed by that release
====================  ===============================================================================

``window`` is ``"all"`` or ``[first, last]`` (inclusive; ``last = -1``: open-ended) over rollout ids
(scalars), sync indices (memory, adapter versions) or cycle indices.

Each evaluation is a :class:`Result`: PASS, FAIL, PENDING (not far enough yet: more data can still decide
it) or MISSING (the run is over and the data is not there). ``final`` says whether more data can change
it — a FAIL that is final is what the live watch aborts on. A criterion over an open-ended window is PENDING
until the run is finished, even when every value so far is good.

Evidence rules: a NaN or infinite number a criterion reads (a value, a logged count, a memory reading, a cycle
time) makes it FAIL; an event time that is not a number is dropped by the reader, so what needed it is MISSING.
A weight sync that some rank has no memory reading for makes the memory criteria MISSING (they do not pass on
fewer syncs), and a run that was resumed is judged on every attempt (:mod:`harness.run_data`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harness.cycles import cycle_times
from harness.run_data import ENDS, Attempt, EventTime, MemoryPoint, Point, RunData, config_text, normalize_phase

__all__ = [
    "Status",
    "Window",
    "Criterion",
    "Result",
    "KINDS",
    "SpecError",
    "build_criterion",
    "evaluate",
    "evaluate_all",
]


# What a trainer rank's allocator held before it slept, best first: reserved counts the cached blocks a sleep also
# empties; allocated alone would let freed cache hide what stayed.
HELD_METRICS = ("memory/reserved_gb", "memory/allocated_gb")


class SpecError(ValueError):
    """A tier spec is wrong; the message names the file, the criterion and the field."""


class Status(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    PENDING = "PENDING"
    MISSING = "MISSING"


@dataclass(frozen=True)
class Window:
    """Inclusive index range; ``last is None``: open-ended (to the end of the run)."""

    first: int = 0
    last: int | None = None

    @property
    def open(self) -> bool:
        return self.last is None

    def contains(self, index: int) -> bool:
        return index >= self.first and (self.last is None or index <= self.last)

    def required(self) -> list[int]:
        """The indices a closed window needs (an open one needs none in particular)."""
        return [] if self.last is None else list(range(self.first, self.last + 1))

    def __str__(self) -> str:
        if self.first == 0 and self.last is None:
            return "all"
        if self.last is None:
            return f"{self.first}–end"
        return str(self.first) if self.first == self.last else f"{self.first}–{self.last}"


@dataclass(frozen=True)
class Criterion:
    id: str
    kind: str
    metrics: tuple[str, ...]  # the first one the run has data for is used
    doc: str
    window: Window
    params: Mapping[str, Any]
    profile: str | None = None
    title: str = ""
    where: str = ""  # "full.toml: criterion 'aime_at_0'"

    @property
    def metric(self) -> str:
        return self.metrics[0]

    def __getitem__(self, name: str) -> Any:
        return self.params[name]


@dataclass
class Result:
    criterion: Criterion
    status: Status
    summary: str  # one line for tables
    final: bool  # True: no later data can change this verdict
    evidence: dict[str, Any] = field(default_factory=dict)  # JSON-able: values, indices, first failure
    where: str | None = None  # file:line of the value that decided it, when one did

    @property
    def id(self) -> str:
        return self.criterion.id

    @property
    def hard_fail(self) -> bool:
        return self.status is Status.FAIL and self.final

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.criterion.kind, "status": str(self.status), "final": self.final,
                "summary": self.summary, "where": self.where, "evidence": self.evidence,
                "doc": self.criterion.doc}


# --- parameters -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    types: tuple[type, ...]
    required: bool = False
    default: Any = None
    choices: tuple[Any, ...] = ()


NUMBER = (int, float)
_COMMON = {"id", "kind", "metric", "doc", "window", "profile", "title"}


def _param_value(where: str, name: str, spec: Param, raw: Any) -> Any:
    if isinstance(raw, bool) and bool not in spec.types:
        raise SpecError(f"{where}: {name!r} must be {_type_names(spec.types)}, got {raw!r}")
    if not isinstance(raw, spec.types):
        raise SpecError(f"{where}: {name!r} must be {_type_names(spec.types)}, got {raw!r}")
    if spec.choices and raw not in spec.choices:
        raise SpecError(f"{where}: {name!r} must be one of {', '.join(map(repr, spec.choices))}, got {raw!r}")
    return float(raw) if spec.types == NUMBER else raw


def _type_names(types: tuple[type, ...]) -> str:
    names = ["a number" if t in NUMBER else f"a {t.__name__}" for t in types]
    return " or ".join(dict.fromkeys(names))


def _decimals(x: float) -> int:
    text = repr(float(x))
    return len(text.split(".")[1]) if "." in text and "e" not in text else 6


# --- building ---------------------------------------------------------------------------------------------
def build_criterion(table: Mapping[str, Any], where: str, profiles: set[str]) -> Criterion:
    """A :class:`Criterion` from one ``[[criterion]]`` table; :class:`SpecError` naming ``where`` and the field."""
    cid = table.get("id")
    if not isinstance(cid, str) or not cid or not cid.replace("_", "").isalnum() or cid != cid.lower():
        raise SpecError(f"{where}: 'id' must be a lowercase identifier (letters, digits, _), got {cid!r}")
    where = f"{where}: criterion {cid!r}"
    kind = table.get("kind")
    if kind not in KINDS:
        raise SpecError(f"{where}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
    metric = table.get("metric")
    metrics = (metric,) if isinstance(metric, str) else tuple(metric) if isinstance(metric, list) else ()
    if not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise SpecError(f"{where}: 'metric' must be a name or a list of names, got {metric!r}")
    doc = table.get("doc")
    if not isinstance(doc, str) or not doc.strip():
        raise SpecError(f"{where}: 'doc' (the recipe sentence it encodes) is required")
    window = _window(where, table.get("window", "all"))
    profile = table.get("profile")
    if profile is not None and profile not in profiles:
        raise SpecError(f"{where}: profile {profile!r} is not declared in [profiles] "
                        f"(declared: {', '.join(sorted(profiles)) or 'none'})")
    kind_spec = KINDS[kind]
    unknown = set(table) - _COMMON - set(kind_spec.params)
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for kind {kind!r} "
                        f"(its fields: {', '.join(sorted(kind_spec.params)) or 'none'})")
    params: dict[str, Any] = {}
    for name, spec in kind_spec.params.items():
        if name in table:
            params[name] = _param_value(where, name, spec, table[name])
        elif spec.required:
            raise SpecError(f"{where}: kind {kind!r} needs {name!r}")
        else:
            params[name] = spec.default
    criterion = Criterion(cid, kind, metrics, doc.strip(), window, params, profile,
                          str(table.get("title", "")), where)
    if kind_spec.check is not None:
        kind_spec.check(criterion)
    return criterion


def _window(where: str, raw: Any) -> Window:
    if raw == "all":
        return Window()
    if (isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
            and raw[0] >= 0 and (raw[1] == -1 or raw[1] >= raw[0])):
        return Window(raw[0], None if raw[1] == -1 else raw[1])
    raise SpecError(f"{where}: 'window' must be \"all\" or [first, last] with 0 <= first <= last "
                    f"(last = -1: to the end), got {raw!r}")


def _check_band(c: Criterion) -> None:
    lo, hi, n = c["lo"], c["hi"], c["n"]
    if lo is None and hi is None:
        raise SpecError(f"{c.where}: a band needs 'lo', 'hi' or both")
    if lo is not None and hi is not None and lo > hi:
        raise SpecError(f"{c.where}: 'lo' {lo} is above 'hi' {hi}")
    if n is None:
        if c["lo_count"] is not None or c["hi_count"] is not None:
            raise SpecError(f"{c.where}: 'lo_count' / 'hi_count' need 'n' (the number of problems)")
        return
    if n <= 0:
        raise SpecError(f"{c.where}: 'n' must be positive, got {n}")
    if c["reduce"] != "each":
        raise SpecError(f"{c.where}: counts ('n') are judged per value: 'reduce' must be \"each\"")
    # The page rounds k/n to the decimals it prints; the counts must be exactly those that round into the band.
    for bound, count_name, pick in (("lo", "lo_count", min), ("hi", "hi_count", max)):
        value = c[bound]
        if value is None:
            continue
        digits = _decimals(value)
        inside = [k for k in range(n + 1) if (lo is None or round(k / n, digits) >= lo - 1e-12) and (
            hi is None or round(k / n, digits) <= hi + 1e-12)]
        if not inside:
            raise SpecError(f"{c.where}: no count of {n} rounds into [{lo}, {hi}]")
        expected = pick(inside)
        if c[count_name] is None:
            raise SpecError(f"{c.where}: with 'n' = {n}, state '{count_name}' = {expected} (the count that "
                            f"rounds to {value})")
        if c[count_name] != expected:
            raise SpecError(f"{c.where}: '{count_name}' = {c[count_name]} disagrees with '{bound}' = {value}: "
                            f"{expected}/{n} is the {'smallest' if pick is min else 'largest'} count that "
                            f"rounds into [{lo}, {hi}]")


def _check_rise(c: Criterion) -> None:
    if c.window.first == c.window.last:
        raise SpecError(f"{c.where}: a rise needs two points: 'window' = [from, to] with from < to")
    n = c["n"]
    if n is None:
        if c["min_rise_count"] is not None:
            raise SpecError(f"{c.where}: 'min_rise_count' needs 'n'")
        return
    expected = math.ceil(c["min_rise"] * n - 1e-9)
    if c["min_rise_count"] != expected:
        raise SpecError(f"{c.where}: 'min_rise_count' must be {expected}: the smallest count k with k/{n} >= "
                        f"{c['min_rise']} (got {c['min_rise_count']})")


def _check_positive(*names: str) -> Callable[[Criterion], None]:
    def check(c: Criterion) -> None:
        for name in names:
            if c[name] is not None and c[name] < 0:
                raise SpecError(f"{c.where}: {name!r} must not be negative, got {c[name]}")
    return check


def _check_cycle(c: Criterion) -> None:
    if c["lo"] > c["hi"]:
        raise SpecError(f"{c.where}: 'lo' {c['lo']} is above 'hi' {c['hi']}")
    _check_positive("lo", "allowed_outside")(c)


# --- helpers ----------------------------------------------------------------------------------------------
def _not_yet(c: Criterion, run: RunData, what: str, **evidence: Any) -> Result:
    """PENDING while the run goes on, MISSING once it is over."""
    if run.finished:
        return Result(c, Status.MISSING, f"{what} (run finished)", True, evidence)
    return Result(c, Status.PENDING, f"{what} (yet)", False, evidence)


def _scalar_series(c: Criterion, run: RunData) -> tuple[str, dict[int, Point]]:
    for metric in c.metrics:
        series = run.series(metric)
        if series:
            return metric, {i: p for i, p in series.items() if c.window.contains(i)}
    return c.metric, {}


def _fmt(x: float, digits: int = 3) -> str:
    if math.isnan(x):
        return "NaN"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if abs(x) < 1e6 else f"{x:.3g}"


def _band_text(lo: float | None, hi: float | None) -> str:
    if lo is None:
        return f"≤ {_fmt(hi)}"  # type: ignore[arg-type]
    if hi is None:
        return f"≥ {_fmt(lo)}"
    return f"[{_fmt(lo)}, {_fmt(hi)}]"


def _in_band(x: float, lo: float | None, hi: float | None) -> bool:
    return math.isfinite(x) and (lo is None or x >= lo - 1e-12) and (hi is None or x <= hi + 1e-12)


class BrokenCount(ValueError):
    """A logged solved count (``<metric>/n_correct`` or ``<metric>/n``) that is not a finite number."""


def _count_of(run: RunData, metric: str, point: Point, n: int) -> tuple[int | None, str]:
    """Solved count of an accuracy point: logged ``<metric>/n_correct`` when there, else value × n.

    Returns (count or None when it cannot be a count of n, a note); :class:`BrokenCount` when a logged count is
    NaN or infinite (broken evidence fails, it is not worked around).
    """
    logged = run.series(f"{metric}/n_correct").get(point.index)
    logged_n = run.series(f"{metric}/n").get(point.index)
    for name, entry in ((f"{metric}/n", logged_n), (f"{metric}/n_correct", logged)):
        if entry is not None and not math.isfinite(entry.value):
            raise BrokenCount(f"{name} is {entry.value} ({entry.where})")
    if logged_n is not None and int(logged_n.value) != n:
        return None, f"the run logged n = {int(logged_n.value)}, not {n}: judged on the value"
    if logged is not None:
        return int(round(logged.value)), ""
    if not math.isfinite(point.value):
        return None, ""
    k = point.value * n
    if abs(k - round(k)) > 0.02:
        return None, f"{_fmt(point.value, 4)} is not a multiple of 1/{n}: judged on the value"
    return int(round(k)), ""


def _evals_text(metric: str) -> str:
    return "eval" if metric.startswith("eval/") else "rollout"


# --- band -------------------------------------------------------------------------------------------------
def _band(c: Criterion, run: RunData) -> Result:
    metric, series = _scalar_series(c, run)
    lo, hi, n = c["lo"], c["hi"], c["n"]
    label = _evals_text(metric)
    required = c.window.required()
    absent = [i for i in required if i not in series]
    values = {i: series[i].value for i in sorted(series)}
    evidence: dict[str, Any] = {"metric": metric, "window": str(c.window), "values": values}

    if c["reduce"] == "mean":
        if absent or not series:
            return _not_yet(c, run, f"{metric}: {len(series)} of {len(required) or '≥1'} {label}s in "
                            f"{c.window}", **evidence, absent=absent)
        if c.window.open and not run.finished:
            return Result(c, Status.PENDING, f"{metric}: mean so far {_fmt(statistics.fmean(values.values()))} "
                          "(open window)", False, evidence)
        mean = statistics.fmean(values.values())
        evidence["mean"] = mean
        ok = _in_band(mean, lo, hi)
        text = (f"mean of {label}s {c.window}: {_fmt(mean)} {'in' if ok else 'outside'} {_band_text(lo, hi)}")
        return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence)

    counts: dict[int, int] = {}
    notes: list[str] = []
    for i, p in sorted(series.items()):
        count = None
        if n is not None:
            try:
                count, note = _count_of(run, metric, p, n)
            except BrokenCount as e:
                evidence |= {"failing_index": i, "value": p.value, "counts": counts}
                return Result(c, Status.FAIL, f"{label}@{i}: {e}", True, evidence, p.where)
            if note:
                notes.append(f"{label}@{i}: {note}")
            if count is not None:
                counts[i] = count
        if count is not None:
            ok = c["lo_count"] is None or count >= c["lo_count"]
            ok = ok and (c["hi_count"] is None or count <= c["hi_count"])
        else:
            ok = _in_band(p.value, lo, hi)
        if not ok:
            evidence |= {"failing_index": i, "value": p.value, "count": count, "counts": counts, "notes": notes}
            shown = f"{_fmt(p.value)}" + (f" = {count}/{n}" if count is not None else "")
            return Result(c, Status.FAIL, f"{label}@{i}: {shown} outside {_band_text_counts(c)}", True,
                          evidence, p.where)
    if n is not None:
        evidence |= {"counts": counts, "notes": notes}
    if absent or not series:
        return _not_yet(c, run, f"{metric}: no value at {label} {', '.join(map(str, absent or [c.window]))}",
                        **evidence, absent=absent)
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, f"{len(series)} {label}s in {_band_text(lo, hi)} so far (open window)",
                      False, evidence)
    if len(series) == 1:
        (i, p), = series.items()
        shown = _fmt(p.value) + (f" = {counts[i]}/{n}" if i in counts else "")
        return Result(c, Status.PASS, f"{label}@{i}: {shown} in {_band_text_counts(c)}", True, evidence, p.where)
    worst_lo, worst_hi = min(values.values()), max(values.values())
    return Result(c, Status.PASS, f"{len(series)} {label}s in {_band_text(lo, hi)} "
                  f"(min {_fmt(worst_lo)}, max {_fmt(worst_hi)})", True, evidence)


def _band_text_counts(c: Criterion) -> str:
    text = _band_text(c["lo"], c["hi"])
    if c["n"] is None:
        return text
    lo_c, hi_c = c["lo_count"], c["hi_count"]
    counts = (f"{lo_c}–{hi_c}" if lo_c is not None and hi_c is not None else
              f"≥ {lo_c}" if lo_c is not None else f"≤ {hi_c}")
    return f"{counts} of {c['n']} ({text} as printed)"


# --- rise_by ----------------------------------------------------------------------------------------------
def _rise_by(c: Criterion, run: RunData) -> Result:
    metric, series = _scalar_series(c, run)
    label = _evals_text(metric)
    start = c.window.first
    end = c.window.last
    evidence: dict[str, Any] = {"metric": metric, "window": str(c.window),
                                "values": {i: series[i].value for i in sorted(series)}}
    if end is None:  # "the last": known only when the run is over
        later = [i for i in series if i > start]
        if not run.finished:
            return Result(c, Status.PENDING, f"{label}@{start} → the last {label}: run not finished", False,
                          evidence)
        end = max(later) if later else None
    first, last = series.get(start), series.get(end) if end is not None else None
    if first is None or last is None:
        absent = [i for i, p in ((start, first), (end, last)) if p is None]
        return _not_yet(c, run, f"{metric}: no value at {label} " + ", ".join(
            "the last" if i is None else str(i) for i in absent), **evidence)
    rise = last.value - first.value
    evidence |= {"from": start, "to": end, "from_value": first.value, "to_value": last.value, "rise": rise}
    n = c["n"]
    text_values = f"{label}@{start} {_fmt(first.value)} → {label}@{end} {_fmt(last.value)}"
    if n is not None:
        try:
            k0, note0 = _count_of(run, metric, first, n)
            k1, note1 = _count_of(run, metric, last, n)
        except BrokenCount as e:
            return Result(c, Status.FAIL, f"{text_values}: {e}", True, evidence, last.where)
        evidence["notes"] = [x for x in (note0, note1) if x]
        if k0 is not None and k1 is not None:
            evidence |= {"from_count": k0, "to_count": k1, "rise_count": k1 - k0}
            ok = k1 - k0 >= c["min_rise_count"]
            text = (f"{label}@{start} {k0}/{n} ({_fmt(first.value)}) → {label}@{end} {k1}/{n} ({_fmt(last.value)}): "
                    f"{k1 - k0:+d} of {n} ({_fmt(rise, 3)}) {'≥' if ok else '<'} +{c['min_rise_count']} "
                    f"(+{_fmt(c['min_rise'])} as printed)")
            return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence, last.where)
    ok = math.isfinite(rise) and rise >= c["min_rise"] - 1e-12
    text = f"{text_values}: {rise:+.3f} {'≥' if ok else '<'} +{_fmt(c['min_rise'])}"
    return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence, last.where)


# --- memory -----------------------------------------------------------------------------------------------
def _memory_series(c: Criterion, run: RunData) -> tuple[str, dict[int, dict[int, MemoryPoint]]]:
    phase = normalize_phase(c["phase"])
    for metric in c.metrics:
        by_rank = run.memory_series(phase, metric)
        if by_rank:
            return metric, {r: {s: p for s, p in syncs.items() if c.window.contains(s)}
                            for r, syncs in sorted(by_rank.items())}
    return c.metric, {}


def _coverage_gaps(c: Criterion, run: RunData, by_rank: dict[int, dict[int, MemoryPoint]]) -> dict[int, list[int]]:
    """Ranks without a reading at syncs the run logged (a ``sync`` event, or another rank's reading).

    Excused: the last sync of an attempt that ended without a finished or failed status (killed mid-sync: the
    readings of the ranks that got theirs out are still judged) and, while the run goes on, the newest sync
    (its readings may still be arriving).
    """
    attempt_of: dict[int, int] = {}
    for syncs in by_rank.values():
        for s, p in syncs.items():
            attempt_of[s] = p.attempt
    for sp in run.syncs:
        if c.window.contains(sp.index):
            attempt_of.setdefault(sp.index, sp.attempt)
    required = set(attempt_of)
    for attempt in run.attempts:
        own = [s for s, a in attempt_of.items() if a == attempt.index]
        logs_statuses = attempt.started or attempt.resumed is not None  # else no end status is expected either
        if logs_statuses and attempt.end is None and own:
            required.discard(max(own))
    if not run.finished and attempt_of:
        required.discard(max(attempt_of))
    return {r: missing for r, syncs in sorted(by_rank.items())
            if (missing := sorted(s for s in required if s not in syncs))}


def _missing_text(gaps: dict[int, list[int]], ranks: int) -> str:
    first = min(s for missing in gaps.values() for s in missing)
    lacking = sorted(r for r, missing in gaps.items() if first in missing)
    syncs = sorted({s for missing in gaps.values() for s in missing})
    more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
    return (f"sync {first}: no reading of rank {lacking[0]}{more}; {len(syncs)} sync(s) lack readings of "
            f"{len(gaps)} of {ranks} rank(s), the criterion does not pass on fewer")


@dataclass(frozen=True)
class _Judged:
    """One memory reading against its reference: the attempt's baseline (or the absolute level)."""

    point: MemoryPoint
    reference: float  # GiB
    deviation: float  # GiB, value − reference (NaN when either is not finite)

    @property
    def bad_number(self) -> bool:
        return not math.isfinite(self.deviation)


def _judge_memory(by_rank: dict[int, dict[int, MemoryPoint]], absolute: float | None
                  ) -> tuple[list[_Judged], list[tuple[int, int]]]:
    """Every reading against its reference; and the (rank, sync) readings with none yet.

    The reference of a reading is ``absolute`` when given, else its rank's baseline in its attempt: the rank's
    first reading of that attempt that is not a startup one (the first sync after the attempt's first
    optimizer step). A startup reading of an attempt with no later reading has no baseline yet.
    """
    judged, unjudged = [], []
    for r, syncs in by_rank.items():
        baseline: dict[int, float] = {}
        for s in sorted(syncs):
            p = syncs[s]
            if not p.startup and p.attempt not in baseline:
                baseline[p.attempt] = absolute if absolute is not None else p.value
        for s in sorted(syncs):
            p = syncs[s]
            ref = absolute if absolute is not None else baseline.get(p.attempt)
            if ref is None:
                unjudged.append((r, s))
                continue
            dev = p.value - ref if math.isfinite(p.value) and math.isfinite(ref) else math.nan
            judged.append(_Judged(p, ref, dev))
    return judged, unjudged


def _returns_to_baseline(c: Criterion, run: RunData) -> Result:
    """Per rank and attempt: startup syncs not above the baseline (+ tolerance); every later sync within it."""
    metric, by_rank = _memory_series(c, run)
    tol, side, absolute = c["tolerance_gb"], c["side"], c["baseline_gb"]
    phase = normalize_phase(c["phase"])
    if not by_rank or not any(by_rank.values()):
        return _not_yet(c, run, f"no {metric} at {phase}", metric=metric, phase=phase)
    judged, unjudged = _judge_memory(by_rank, absolute)
    later = [j for j in judged if not j.point.startup]
    startup = [j for j in judged if j.point.startup]
    failures = [j for j in judged if j.bad_number or j.deviation > tol + 1e-9 or (
        not j.point.startup and side == "both" and j.deviation < -tol - 1e-9)]
    n_syncs = len({j.point.sync for j in later})
    startup_syncs = sorted({p.sync for syncs in by_rank.values() for p in syncs.values() if p.startup})
    references = sorted({j.reference for j in later if math.isfinite(j.reference)})
    evidence: dict[str, Any] = {
        "metric": metric, "phase": phase, "ranks": len(by_rank), "syncs": n_syncs, "tolerance_gb": tol,
        "baseline": "absolute" if absolute is not None else
        "per rank and attempt: its reading after the first sync that follows the first optimizer step",
        "startup_syncs": startup_syncs, "attempts": len({j.point.attempt for j in judged}) or 1,
    }
    if references:
        evidence |= {"baseline_gb_min": references[0], "baseline_gb_max": references[-1]}
    worst = max((j for j in later if not j.bad_number), key=lambda j: abs(j.deviation), default=None)
    if worst is not None:
        evidence |= {"worst_deviation_gb": abs(worst.deviation), "worst_rank": worst.point.rank,
                     "worst_sync": worst.point.sync}
    highest = max((j for j in startup if not j.bad_number), key=lambda j: j.deviation, default=None)
    if highest is not None:
        evidence |= {"startup_highest_deviation_gb": highest.deviation, "startup_highest_rank": highest.point.rank,
                     "startup_highest_sync": highest.point.sync}
    if unjudged:
        evidence["unjudged"] = [f"rank {r} sync {s}" for r, s in unjudged[:20]]
    reference = f"{_fmt(absolute, 2)} GB" if absolute is not None else "baseline"
    if failures:
        first = min(failures, key=lambda j: (j.point.sync, j.point.rank))
        p, dev = first.point, first.deviation
        failing_ranks = sorted({j.point.rank for j in failures})
        evidence |= {"first_failing_sync": p.sync, "first_failing_rank": p.rank, "value_gb": p.value,
                     "baseline_gb": first.reference, "deviation_gb": dev, "failing_ranks": failing_ranks,
                     "failing_points": len(failures), "first_failing_is_startup": p.startup}
        against = reference if absolute is not None else f"baseline {_fmt(first.reference, 2)} GB"
        at = f"at startup sync {p.sync}" if p.startup else f"after sync {p.sync}"
        if first.bad_number:
            broken = (f"the reading is {_fmt(p.value)} GB" if not math.isfinite(p.value) else
                      f"its baseline is {_fmt(first.reference)} GB")
            text = f"rank {p.rank} {at}: {broken}, not a number to judge"
        elif p.startup:
            text = (f"rank {p.rank} {at}: {_fmt(p.value, 2)} GB is above {against} ({dev:+.2f} GB; a startup "
                    f"sync may be at most +{_fmt(tol, 2)} GB above it)")
        else:
            text = (f"rank {p.rank} {at}: {_fmt(p.value, 2)} GB vs {against} ({dev:+.2f} GB, tolerance "
                    f"±{_fmt(tol, 2)} GB)")
        text += f"; {len(failing_ranks)} of {len(by_rank)} ranks fail"
        return Result(c, Status.FAIL, text, True, evidence, p.where)
    if n_syncs < c["min_syncs"]:
        return _not_yet(c, run, f"{n_syncs} sync(s) after training of {len(by_rank)} rank(s); needs "
                        f"{c['min_syncs']}", **evidence)
    gaps = _coverage_gaps(c, run, by_rank)
    if gaps and run.finished:
        evidence["missing"] = {str(r): s for r, s in gaps.items()}
        return Result(c, Status.MISSING, _missing_text(gaps, len(by_rank)), True, evidence)
    text = (f"{len(by_rank)} ranks × {n_syncs} syncs within ±{_fmt(tol, 2)} GB of {reference}"
            + (f" (worst {abs(worst.deviation):.2f} GB: rank {worst.point.rank}, sync {worst.point.sync})"
               if worst else ""))
    if highest is not None:
        lowest = min((j for j in startup if not j.bad_number), key=lambda j: j.deviation)
        text += (f"\nstartup sync{'s' if len(startup_syncs) > 1 else ''} {', '.join(map(str, startup_syncs))}: not "
                 f"above {reference} + {_fmt(tol, 2)} GB (from {lowest.deviation:+.2f} to {highest.deviation:+.2f} GB)")
    if unjudged:
        text += f"\n{len(unjudged)} startup reading(s) of attempts with no later sync: no baseline to judge them by"
    if c.window.open and not run.finished:
        head, _, rest = text.partition("\n")
        return Result(c, Status.PENDING, head + " so far" + ("\n" + rest if rest else ""), False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through (xs, ys): Σ(x−x̄)(y−ȳ) / Σ(x−x̄)²; needs two distinct xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("slope of points that share one x")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _no_growth(c: Criterion, run: RunData) -> Result:
    """Least-squares slope per rank of the readings after training (startup syncs left out: the optimizer
    state is not there yet), each relative to its attempt's baseline so that a resume's new level is no trend."""
    metric, by_rank = _memory_series(c, run)
    phase, limit, need = normalize_phase(c["phase"]), c["max_slope_gb_per_sync"], c["min_points"]
    evidence: dict[str, Any] = {"metric": metric, "phase": phase, "max_slope_gb_per_sync": limit,
                                "ranks": len(by_rank)}
    judged, _ = _judge_memory(by_rank, None)
    bad = [j for j in judged if not j.point.startup and j.bad_number]
    if bad:
        p = min(bad, key=lambda j: (j.point.sync, j.point.rank)).point
        evidence |= {"first_failing_sync": p.sync, "first_failing_rank": p.rank}
        return Result(c, Status.FAIL, f"rank {p.rank} after sync {p.sync}: the reading is {_fmt(p.value)} GB, not a "
                      "number to fit a slope to", True, evidence, p.where)
    points: dict[int, list[tuple[float, float]]] = {}
    for j in judged:
        if not j.point.startup:
            points.setdefault(j.point.rank, []).append((float(j.point.sync), j.deviation))
    slopes: dict[int, float] = {}
    for r, xy in points.items():
        if len(xy) >= need:
            slopes[r] = least_squares_slope([x for x, _ in xy], [y for _, y in xy])
    evidence["ranks_with_enough_points"] = len(slopes)
    if not slopes:
        most = max((len(xy) for xy in points.values()), default=0)
        return _not_yet(c, run, f"{most} sync(s) after training per rank; the slope needs {need}", **evidence)
    worst_rank = max(slopes, key=lambda r: slopes[r])
    worst = slopes[worst_rank]
    evidence |= {"worst_rank": worst_rank, "worst_slope_gb_per_sync": worst,
                 "growing_ranks": sorted(r for r, s in slopes.items() if s > limit)}
    ok = worst <= limit + 1e-12
    text = (f"steepest: rank {worst_rank} {worst:+.4f} GB/sync over {len(points[worst_rank])} syncs "
            f"({'≤' if ok else '>'} {_fmt(limit, 4)})")
    if not ok:
        # A trend can still flatten out: final only once the run is over.
        return Result(c, Status.FAIL, text, run.finished, evidence)
    if (c.window.open and not run.finished) or len(slopes) < len(by_rank):
        return (Result(c, Status.PENDING, text + " so far", False, evidence) if not run.finished else
                Result(c, Status.MISSING, f"{len(by_rank) - len(slopes)} rank(s) with fewer than {need} syncs",
                       True, evidence))
    gaps = _coverage_gaps(c, run, by_rank)
    if gaps:
        evidence["missing"] = {str(r): s for r, s in gaps.items()}
        return Result(c, Status.MISSING, _missing_text(gaps, len(by_rank)), True, evidence)
    return Result(c, Status.PASS, text, True, evidence)


# --- config -----------------------------------------------------------------------------------------------
def _config_equals(c: Criterion, run: RunData) -> Result:
    expected = config_text(c["value"])
    for key in c.metrics:
        entry = run.config.get(key)
        if entry is not None:
            ok = entry.value.strip() == expected
            evidence = {"key": key, "expected": expected, "actual": entry.value}
            text = f"{key} {entry.value}" + ("" if ok else f" (expected {expected})")
            return Result(c, Status.PASS if ok else Status.FAIL, text, True, evidence, entry.where)
    return _not_yet(c, run, f"{c.metric} not in the resolved config", key=c.metric, expected=expected,
                    config_keys=len(run.config))


# --- cycle time -------------------------------------------------------------------------------------------
def _cycle_time_within(c: Criterion, run: RunData) -> Result:
    scale = 60.0 if c["unit"] == "min" else 1.0
    unit = c["unit"]
    lo, hi = c["lo"], c["hi"]
    times = cycle_times(run)
    cycles = {i: cyc for i, cyc in sorted(times.cycles.items()) if c.window.contains(i)}
    excluded = {i: why for i, why in times.excluded.items() if c.window.contains(i)}
    values = {i: cyc.seconds / scale for i, cyc in cycles.items()}
    evidence: dict[str, Any] = {"rule": times.rule, "unit": unit, "window": str(c.window), "values": values,
                                "excluded": excluded,
                                "eval_excluded": {i: cyc.eval_seconds / scale for i, cyc in cycles.items()
                                                  if cyc.eval_seconds}}
    if not cycles:
        return _not_yet(c, run, f"no cycle times in {c.window} (rule: {times.rule})", **evidence)
    ordered = list(values.values())
    median = statistics.median(ordered)
    slowest = max(values, key=lambda i: values[i])
    fastest = min(values, key=lambda i: values[i])
    evidence |= {"median": median, "worst": values[slowest], "worst_cycle": slowest,
                 "fastest": values[fastest], "fastest_cycle": fastest}
    outside = [i for i in values if not _in_band(values[i], lo, hi)]
    evidence["outside"] = outside
    stats = (f"median {_fmt(median, 2)} {unit}, worst {_fmt(values[slowest], 2)} {unit} (cycle {slowest}), "
             f"fastest {_fmt(values[fastest], 2)}")
    if len(outside) > c["allowed_outside"]:
        i = outside[c["allowed_outside"]]
        evidence["first_failing_cycle"] = i
        return Result(c, Status.FAIL, f"cycle {i}: {_fmt(values[i], 2)} {unit} outside "
                      f"[{_fmt(lo)}, {_fmt(hi)}] {unit}; {stats}", True, evidence, cycles[i].where)
    absent = [i for i in c.window.required() if i not in cycles and i not in excluded]
    if absent:
        return _not_yet(c, run, f"no cycle time for cycle(s) {', '.join(map(str, absent[:5]))}", **evidence)
    text = f"{len(values)} cycles in [{_fmt(lo)}, {_fmt(hi)}] {unit}: {stats}"
    if excluded:
        text += f"; left out: {'; '.join(f'cycle {i} {why}' for i, why in sorted(excluded.items()))}"
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, text + " so far", False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


# --- completion -------------------------------------------------------------------------------------------
def _attempt_spans(run: RunData) -> tuple[list[tuple[float, float]], str | None]:
    """(start, end) unix seconds of each attempt: from its started (or resumed) status, else its first timed
    event, to its finished / failed status, else its last timed event. Time between attempts (a killed run
    waiting for its resume) is no run time. The second value names a status whose time is not a number."""
    bounds = [a.seq for a in run.attempts] or [0]
    bounds[0] = 0
    spans: list[tuple[float, float]] = []
    for i, attempt in enumerate(run.attempts or [None]):
        lo, hi = bounds[i], bounds[i + 1] if i + 1 < len(bounds) else run.events
        times = [e.time for e in run.event_times if lo <= e.seq < hi]
        statuses = [s for s in run.status if lo <= s.seq < hi]
        for status in statuses:
            if status.status in ("started", *ENDS) and status.time is None:
                return [], f"the {status.status} status ({status.where}) has no valid time"
        start = attempt.start_time if attempt is not None and attempt.start_time is not None else min(
            times, default=None)
        end = attempt.end.time if attempt is not None and attempt.end is not None else max(times, default=None)
        if start is not None and end is not None:
            spans.append((start, end))
    return spans, None


def _completes_within(c: Criterion, run: RunData) -> Result:
    limit_s = c["max_minutes"] * 60.0
    last_status = run.status[-1] if run.status else None
    ended = last_status if last_status is not None and last_status.status in ENDS else None
    rollouts = {e.rollout_id for e in run.event_times if e.event == "rollout"} or {
        i for m, s in run.scalars.items() if m.startswith("rollout/") for i in s}
    evidence: dict[str, Any] = {"max_minutes": c["max_minutes"], "rollouts": len(rollouts),
                                "min_rollouts": c["min_rollouts"], "attempts": max(len(run.attempts), 1)}
    if ended is not None and ended.status == "failed":
        evidence["error"] = ended.error
        return Result(c, Status.FAIL, f"the run failed: {ended.error or 'no error message'}", True, evidence,
                      ended.where)
    spans, broken = _attempt_spans(run)
    if broken is not None:
        evidence["broken"] = broken
        return _not_yet(c, run, broken, **evidence)
    if not spans:
        return _not_yet(c, run, "no start time (status or timed events)", **evidence)
    elapsed = sum(end - start for start, end in spans)
    evidence["minutes"] = elapsed / 60.0
    earlier = [f"{a.label} {a.end.status}" + (f" ({a.end.error})" if a.end.error else "")
               for a in run.attempts[:-1] if a.end is not None and a.end.status == "failed"]
    resumed = f" over {len(spans)} attempts" if len(spans) > 1 else ""
    if earlier:
        evidence["earlier_failures"] = earlier
        resumed += f" ({'; '.join(earlier)}; resumed)"
    if elapsed > limit_s:
        return Result(c, Status.FAIL, f"{_fmt(elapsed / 60, 2)} min > {_fmt(c['max_minutes'])} min "
                      f"({len(rollouts)} rollouts){resumed}", True, evidence)
    if ended is None:
        text = f"running for {_fmt(elapsed / 60, 2)} min by its events, {len(rollouts)} rollouts{resumed}"
        last = max((e.time for e in run.event_times), default=None)
        if run.read_at is not None and last is not None:
            since = (run.read_at - last) / 60.0
            evidence["minutes_since_last_event"] = since
            text += (f"; last event {_fmt(since, 2)} min ago by the clock" if since >= 0 else
                     f"; last event {_fmt(-since, 2)} min ahead of this machine's clock")
        return _not_yet(c, run, text, **evidence)
    if len(rollouts) < c["min_rollouts"]:
        return Result(c, Status.FAIL, f"finished after {len(rollouts)} rollouts; needs ≥ {c['min_rollouts']}",
                      True, evidence, ended.where)
    return Result(c, Status.PASS, f"finished in {_fmt(elapsed / 60, 2)} min ≤ {_fmt(c['max_minutes'])} min, "
                  f"{len(rollouts)} rollouts{resumed}", True, evidence, ended.where)


# --- adapter versions -------------------------------------------------------------------------------------
def _version_after_start(run: RunData, attempt: Attempt, step: int) -> tuple[int | None, str]:
    """The version an attempt's first sync must deliver, and why: after a resume at rollout R, the version the
    earlier attempts held after training rollout R − 1 (what the checkpoint saved) + ``step``; after a start
    over without a checkpoint, 1. None when the saved version is not in the run."""
    if attempt.resumed is None or attempt.next_rollout == 0:
        if attempt.resumed is not None and attempt.resumed.next_rollout is None:
            return None, f"{attempt.label} resumed at an unlogged rollout"
        return 1, f"{attempt.label} started over: version 1"
    saved_rollout = attempt.next_rollout - 1
    saved = [s for s in run.syncs if s.attempt < attempt.index and s.rollout_id == saved_rollout
             and s.version is not None]
    if not saved:
        return None, (f"the version saved with rollout {saved_rollout} is not in the run (no sync after training "
                      f"rollout {saved_rollout} before {attempt.label})")
    version: int = saved[-1].version  # type: ignore[assignment]  # None filtered out above
    return version + step, f"the resume at rollout {attempt.next_rollout}: saved version {version} + {step}"


def _advances(c: Criterion, run: RunData) -> Result:
    syncs = [s for s in run.syncs if c.window.contains(s.index)]
    # With ``adapter/engine_version`` among the metrics and logged: the sent versions must advance, and at every
    # sync the engine must report the sent one active (its own answer, so a stuck engine fails here).
    engine = "adapter/engine_version" in c.metrics and any(s.engine_version is not None for s in run.syncs)
    result = _versions_advance(c, run, syncs)
    if engine:
        result.evidence["metric"] = "adapter/engine_version"
    if not engine or result.status is Status.FAIL:
        return result
    for s in syncs:
        if s.engine_version != s.version:
            result.evidence |= {"first_failing_sync": s.index, "engine_version": s.engine_version}
            said = "reports no version" if s.engine_version is None else f"reports version {s.engine_version} active"
            return Result(c, Status.FAIL, f"sync {s.index}: the engine {said}, version {s.version} was sent", True,
                          result.evidence, s.where)
    return result


def _versions_advance(c: Criterion, run: RunData, syncs: list) -> Result:
    step = c["step"]
    versions = [s.version for s in syncs]
    evidence: dict[str, Any] = {"versions": versions, "step": step}
    if any(v is None for v in versions):
        bad = next(s for s in syncs if s.version is None)
        return Result(c, Status.FAIL, f"sync {bad.index} carries no adapter version", True, evidence, bad.where)
    unknown: list[str] = []
    starts: list[str] = []
    for previous, current in zip(syncs, syncs[1:]):
        if current.attempt != previous.attempt and current.attempt < len(run.attempts):
            expected, why = _version_after_start(run, run.attempts[current.attempt], step)
            if expected is None:
                unknown.append(f"sync {current.index}: {why}")
                continue
            starts.append(f"sync {current.index} v{current.version} ({why})")
            if current.version != expected:
                evidence |= {"first_failing_sync": current.index, "expected": expected}
                return Result(c, Status.FAIL, f"sync {current.index}: version {current.version}, expected "
                              f"{expected} ({why})", True, evidence, current.where)
        elif current.version - previous.version != step:  # type: ignore[operator]
            evidence |= {"first_failing_sync": current.index}
            return Result(c, Status.FAIL, f"sync {current.index}: version {current.version} after "
                          f"{previous.version} (expected +{step})", True, evidence, current.where)
    if starts:
        evidence["attempt_starts"] = starts
    if len(syncs) < 2:
        return _not_yet(c, run, f"{len(syncs)} sync(s); needs 2", **evidence)
    if unknown:
        evidence["unverified"] = unknown
        return _not_yet(c, run, f"{unknown[0]}: that sync's version cannot be checked", **evidence)
    text = f"{len(syncs)} syncs, versions {versions[0]} → {versions[-1]} by +{step}"
    if starts:
        text = (f"{len(syncs)} syncs over {len(starts) + 1} attempts, +{step} within each; after each resume the "
                f"saved version + {step}: " + "; ".join(starts))
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, text + " so far", False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


# --- replicas ---------------------------------------------------------------------------------------------
def _replicas_agree(c: Criterion, run: RunData) -> Result:
    steps = sorted(run.replicas)  # (attempt, step), in run order
    ranks = sorted({r for by_rank in run.replicas.values() for r in by_rank})
    compared = 0
    labels: set[str] = set()
    evidence: dict[str, Any] = {"steps": len(steps), "ranks": ranks}
    for attempt, step in steps:
        by_rank = run.replicas[(attempt, step)]
        holders: dict[str, dict[str, list[int]]] = {}  # label -> digest -> ranks
        for rank, point in sorted(by_rank.items()):
            for label, digest in point.digests.items():
                holders.setdefault(label, {}).setdefault(digest, []).append(rank)
        labels.update(holders)
        for label in sorted(holders):
            sides = holders[label]
            if sum(len(r) for r in sides.values()) > 1:
                compared += 1
            if len(sides) > 1:
                groups = sorted(sides.values(), key=lambda g: (-len(g), g))
                where = next(p.where for p in by_rank.values() if p.seq == max(
                    by_rank[r].seq for g in groups for r in g))
                evidence |= {"first_failing_step": step, "tensor": label, "rank_groups": groups,
                             "digests": {d[:16]: g for d, g in sides.items()}, "attempt": attempt}
                split = " vs ".join("ranks " + ",".join(map(str, g)) if len(g) > 1 else f"rank {g[0]}" for g in groups)
                label_step = f"step {step}" + (f" (attempt {attempt + 1})" if run.attempts and len(run.attempts) > 1
                                               else "")
                return Result(c, Status.FAIL, f"{label_step}: replicas of {label} differ: {split}", True, evidence,
                              where)
    evidence |= {"tensors": len(labels), "replica_comparisons": compared}
    if len(steps) < c["min_steps"]:
        return _not_yet(c, run, f"{len(steps)} step(s) with replica digests; needs {c['min_steps']}", **evidence)
    what = (f"{len(steps)} steps, {len(labels)} tensors on {len(ranks)} ranks: every replica equal "
            f"({compared} comparisons)" if len(ranks) > 1 else
            f"{len(steps)} steps, {len(labels)} tensors on one rank: no tensor has a replica to compare")
    if not run.finished:
        return Result(c, Status.PENDING, what + " so far", False, evidence)
    return Result(c, Status.PASS, what, True, evidence)


# --- delivered == trained -------------------------------------------------------------------------------------
def _delivered(c: Criterion, run: RunData) -> Result:
    syncs = [s for s in run.syncs if c.window.contains(s.index)]
    evidence: dict[str, Any] = {"syncs": len(syncs)}
    judged = 0
    for s in syncs:
        if s.trained_digests is None or not s.engine_digests:
            evidence["without_digests"] = evidence.get("without_digests", 0) + 1
            continue
        judged += 1
        for e in s.engine_digests:
            which = f"engine {e.engine}"
            base = {"first_failing_sync": s.index, "version": s.version, "engine": e.engine}
            if e.version != s.version:
                evidence |= base
                return Result(c, Status.FAIL, f"sync {s.index}: {which} reports version {e.version} active, "
                              f"version {s.version} was sent", True, evidence, s.where)
            for index, digest in enumerate(s.trained_digests):
                got = e.chunks.get(index)
                if got is None:
                    evidence |= base | {"chunk": index, "problem": "missing"}
                    return Result(c, Status.FAIL, f"sync {s.index}: chunk {index} of version {s.version} missing at "
                                  f"{which} ({len(e.chunks)} of {len(s.trained_digests)} chunks activated)", True,
                                  evidence, s.where)
                if got != digest:
                    evidence |= base | {"chunk": index, "problem": "differs", "activated": got, "trained": digest}
                    return Result(c, Status.FAIL, f"sync {s.index}: chunk {index} of version {s.version} differs at "
                                  f"{which}: activated {got[:12]}…, trained {digest[:12]}…", True, evidence, s.where)
            extra = sorted(set(e.chunks) - set(range(len(s.trained_digests))))
            if extra:
                evidence |= base | {"chunk": extra[0], "problem": "never sent"}
                return Result(c, Status.FAIL, f"sync {s.index}: {which} reports chunk {extra[0]} of version "
                              f"{s.version}, which the trainer never sent", True, evidence, s.where)
    evidence["judged"] = judged
    missing = evidence.get("without_digests", 0)
    if judged < c["min_syncs"] or (missing and run.finished):
        return _not_yet(c, run, f"{judged} sync(s) with both digests"
                        + (f"; {missing} without" if missing else "") + f"; needs {c['min_syncs']}", **evidence)
    text = f"{judged} syncs: every chunk the engine activated equals the trained one"
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, text + " so far", False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


# --- the memory dance (recipe §5.1, §5.4): the trainer asleep, the engine released ------------------------------
@dataclass(frozen=True)
class _Asleep:
    """What one trainer rank kept on the device while asleep after one sleep (the readings around it)."""

    rank: int
    sync: int
    held_gb: float  # the rank's allocator held (reserved, else allocated) before it slept
    freed_gb: float  # what left the whole device while it went to sleep
    where: str  # its after-sleep reading

    @property
    def resident_gb(self) -> float:
        return self.held_gb - self.freed_gb


def _asleep_readings(c: Criterion, run: RunData) -> tuple[str, str, list[_Asleep], list[str]]:
    """(physical metric, held metric, one :class:`_Asleep` per rank and sync with every reading, the readings
    that lack their pair: "rank 0 sync 5: no after_offload reading")."""
    before, after = normalize_phase(c["before_phase"]), normalize_phase(c["after_phase"])
    physical = next((m for m in c.metrics if run.memory_series(before, m) or run.memory_series(after, m)), c.metric)
    held_metric = next((m for m in HELD_METRICS if run.memory_series(before, m)), HELD_METRICS[-1])
    phys_b, phys_a = run.memory_series(before, physical), run.memory_series(after, physical)
    held = run.memory_series(before, held_metric)
    out: list[_Asleep] = []
    unpaired: list[str] = []
    for rank in sorted(set(phys_b) | set(phys_a) | set(held)):
        syncs = set(phys_b.get(rank, {})) | set(phys_a.get(rank, {})) | set(held.get(rank, {}))
        for sync in sorted(s for s in syncs if c.window.contains(s)):
            b, a, h = (series.get(rank, {}).get(sync) for series in (phys_b, phys_a, held))
            lacking = [f"{name} at {phase}" for name, phase, p in ((physical, before, b), (physical, after, a),
                                                                   (held_metric, before, h)) if p is None]
            if lacking:
                unpaired.append(f"rank {rank} sync {sync}: no {' and no '.join(lacking)}")
                continue
            out.append(_Asleep(rank, sync, h.value, b.value - a.value, a.where))  # type: ignore[union-attr]
    return physical, held_metric, out, unpaired


def _resident_while_asleep(c: Criterion, run: RunData) -> Result:
    """Per trainer rank and sleep: held before the sleep − what left the device ≤ ``max_gb``."""
    before, after = normalize_phase(c["before_phase"]), normalize_phase(c["after_phase"])
    physical, held_metric, asleep, unpaired = _asleep_readings(c, run)
    limit = c["max_gb"]
    evidence: dict[str, Any] = {"physical_metric": physical, "held_metric": held_metric, "max_gb": limit,
                                "phases": [before, after], "sleeps": len(asleep),
                                "ranks": len({a.rank for a in asleep})}
    if not asleep and not unpaired:
        return _not_yet(c, run, f"no {physical} at {before} and {after}", **evidence)
    broken = [a for a in asleep if not math.isfinite(a.resident_gb)]
    over = [a for a in asleep if math.isfinite(a.resident_gb) and a.resident_gb > limit + 1e-9]
    if broken or over:
        first = min(broken or over, key=lambda a: (a.sync, a.rank))
        evidence |= {"first_failing_rank": first.rank, "first_failing_sync": first.sync, "phase": after,
                     "resident_gb": first.resident_gb, "held_gb": first.held_gb, "freed_gb": first.freed_gb,
                     "failing_ranks": sorted({a.rank for a in broken + over})}
        if broken:
            text = (f"rank {first.rank} at {after} of sync {first.sync}: the readings are not numbers to judge (held "
                    f"{_fmt(first.held_gb)} GB, freed {_fmt(first.freed_gb)} GB)")
        else:
            held = held_metric.split("/")[-1].removesuffix("_gb")
            text = (f"rank {first.rank} at {after} of sync {first.sync}: {first.resident_gb:.2f} GB still on the "
                    f"device while asleep > {_fmt(limit, 2)} GB ({held} {first.held_gb:.2f} GB before the sleep, "
                    f"{first.freed_gb:.2f} GB left the device)")
        return Result(c, Status.FAIL, text, True, evidence, first.where)
    if unpaired and run.finished:
        evidence["unpaired"] = unpaired[:20]
        return Result(c, Status.MISSING, f"{unpaired[0]}; {len(unpaired)} sleep(s) without every reading, the "
                      "criterion does not pass on fewer", True, evidence)
    syncs = len({a.sync for a in asleep})
    if syncs < c["min_syncs"] or not asleep:
        return _not_yet(c, run, f"{syncs} sleep(s) with both readings; needs {c['min_syncs']}", **evidence)
    worst = max(asleep, key=lambda a: a.resident_gb)
    evidence |= {"worst_resident_gb": worst.resident_gb, "worst_rank": worst.rank, "worst_sync": worst.sync}
    text = (f"{evidence['ranks']} rank(s) × {syncs} sleeps: at most {worst.resident_gb:.2f} GB on the device while "
            f"asleep (rank {worst.rank}, sync {worst.sync}) ≤ {_fmt(limit, 2)} GB")
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, text + " so far", False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


def _trained_rollouts(run: RunData) -> dict[int, EventTime]:
    """The ``train`` event of every trained rollout (a later attempt's replaces an earlier one's)."""
    return {e.rollout_id: e for e in run.event_times if e.event == "train" and e.rollout_id is not None}


def _released_while_training(c: Criterion, run: RunData) -> Result:
    """Per engine and trained rollout: a release of ``tag`` before the train event, no resume of it before that
    event, the engine not saying its weights stayed, and (``min_released_gb``) that much leaving the device."""
    tag, need_gb, physical = c["tag"], c["min_released_gb"], c.metric
    trains = {r: e for r, e in sorted(_trained_rollouts(run).items()) if c.window.contains(r)}
    engines = sorted({p.engine for p in run.engine_memory})
    evidence: dict[str, Any] = {"tag": tag, "min_released_gb": need_gb, "metric": physical, "engines": engines,
                                "rollouts": len(trains)}
    if not engines:
        return _not_yet(c, run, "no engine memory readings (memory events with 'engine')", **evidence)
    freed_by: dict[str, float] = {}
    for rollout, train in trains.items():
        for engine in engines:
            mine = [p for p in run.engine_memory if p.engine == engine and p.rollout_id == rollout and tag in p.tags]
            released = [p for p in mine if p.phase == "after_release" and p.seq < train.seq]
            at = f"engine {engine}, rollout {rollout}"
            base = {"first_failing_engine": engine, "first_failing_rollout": rollout}
            if not released:
                evidence |= base | {"phase": "after_release"}
                return Result(c, Status.FAIL, f"{at}: no release of its {tag} before training (no after_release "
                              f"reading with tag {tag!r} before the train event)", True, evidence, train.where)
            rel = released[-1]
            sync = f" (sync {rel.sync})" if rel.sync is not None else ""
            base |= {"first_failing_sync": rel.sync}
            back = [p for p in mine if p.phase in ("before_resume", "after_resume") and rel.seq < p.seq < train.seq]
            if back:
                evidence |= base | {"phase": back[0].phase}
                return Result(c, Status.FAIL, f"{at}{sync}: {back[0].phase} of its {tag} before training ended: the "
                              "engine held them while the trainer trained", True, evidence, back[0].where)
            if rel.weights_resident is True and tag == "weights":
                evidence |= base | {"phase": "after_release"}
                return Result(c, Status.FAIL, f"{at}{sync}: after_release says its weights are still resident", True,
                              evidence, rel.where)
            if need_gb is None:
                continue
            before = [p for p in mine if p.phase == "before_release" and p.seq < rel.seq]
            start = before[-1].values.get(physical) if before else None
            end = rel.values.get(physical)
            if start is None or end is None:
                evidence |= base | {"phase": "before_release" if start is None else "after_release"}
                return Result(c, Status.MISSING if run.finished else Status.PENDING,
                              f"{at}{sync}: no {physical} at {'before_release' if start is None else 'after_release'}: "
                              f"what the release freed cannot be measured", run.finished, evidence, rel.where)
            freed = start - end
            freed_by[f"{engine}:{rollout}"] = freed
            if not math.isfinite(freed) or freed < need_gb - 1e-9:
                evidence |= base | {"phase": "after_release", "freed_gb": freed}
                return Result(c, Status.FAIL, f"{at}{sync}: the release of its {tag} freed {_fmt(freed, 2)} GB of the "
                              f"device < {_fmt(need_gb, 2)} GB: the {tag} stayed resident", True, evidence, rel.where)
    if freed_by:
        evidence |= {"least_freed_gb": min(freed_by.values()), "most_freed_gb": max(freed_by.values())}
    if len(trains) < c["min_rollouts"]:
        return _not_yet(c, run, f"{len(trains)} trained rollout(s); needs {c['min_rollouts']}", **evidence)
    text = f"{len(engines)} engine(s) × {len(trains)} rollouts: {tag} released before every train step, resumed after"
    if freed_by:
        text += f" ({_fmt(min(freed_by.values()), 2)}–{_fmt(max(freed_by.values()), 2)} GB left the device)"
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, text + " so far", False, evidence)
    return Result(c, Status.PASS, text, True, evidence)


# --- registry ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    evaluate: Callable[[Criterion, RunData], Result]
    params: Mapping[str, Param]
    check: Callable[[Criterion], None] | None = None


_PHASE = Param((str,), default="after_update_weights")
KINDS: dict[str, Kind] = {
    "band": Kind(_band, {
        "lo": Param(NUMBER), "hi": Param(NUMBER), "reduce": Param((str,), default="each", choices=("each", "mean")),
        "n": Param((int,)), "lo_count": Param((int,)), "hi_count": Param((int,)),
    }, _check_band),
    "rise_by": Kind(_rise_by, {"min_rise": Param(NUMBER, required=True), "n": Param((int,)),
                               "min_rise_count": Param((int,))}, _check_rise),
    "returns_to_baseline": Kind(_returns_to_baseline, {
        "tolerance_gb": Param(NUMBER, required=True), "phase": _PHASE,
        "side": Param((str,), default="both", choices=("both", "above")), "baseline_gb": Param(NUMBER),
        "min_syncs": Param((int,), default=2),
    }, _check_positive("tolerance_gb", "baseline_gb", "min_syncs")),
    "no_growth": Kind(_no_growth, {"max_slope_gb_per_sync": Param(NUMBER, required=True), "phase": _PHASE,
                                   "min_points": Param((int,), default=5)}, _check_positive("min_points")),
    "config_equals": Kind(_config_equals, {"value": Param((str, int, float, bool), required=True)}),
    "cycle_time_within": Kind(_cycle_time_within, {
        "lo": Param(NUMBER, required=True), "hi": Param(NUMBER, required=True),
        "unit": Param((str,), default="min", choices=("s", "min")), "allowed_outside": Param((int,), default=0),
    }, _check_cycle),
    "completes_within": Kind(_completes_within, {"max_minutes": Param(NUMBER, required=True),
                                                 "min_rollouts": Param((int,), default=0)},
                             _check_positive("max_minutes", "min_rollouts")),
    "advances": Kind(_advances, {"step": Param((int,), default=1)}),
    "replicas_agree": Kind(_replicas_agree, {"min_steps": Param((int,), default=1)}, _check_positive("min_steps")),
    "delivered": Kind(_delivered, {"min_syncs": Param((int,), default=1)}, _check_positive("min_syncs")),
    "resident_while_asleep": Kind(_resident_while_asleep, {
        "max_gb": Param(NUMBER, required=True), "before_phase": Param((str,), default="before_offload"),
        "after_phase": Param((str,), default="after_offload"), "min_syncs": Param((int,), default=2),
    }, _check_positive("max_gb", "min_syncs")),
    "released_while_training": Kind(_released_while_training, {
        "tag": Param((str,), default="weights"), "min_released_gb": Param(NUMBER),
        "min_rollouts": Param((int,), default=2),
    }, _check_positive("min_released_gb", "min_rollouts")),
}


def evaluate(criterion: Criterion, run: RunData) -> Result:
    """One criterion's verdict on ``run`` as it is now."""
    return KINDS[criterion.kind].evaluate(criterion, run)


def evaluate_all(criteria: list[Criterion], run: RunData) -> list[Result]:
    return [evaluate(c, run) for c in criteria]
