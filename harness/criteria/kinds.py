"""Every kind of criterion, with its parameters and its spec check; building a :class:`Criterion` from a spec's
table, and judging it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.criteria.band import band, check_band
from harness.criteria.completion import completes_within
from harness.criteria.config_equals import config_equals
from harness.criteria.criterion import Criterion, Result, SpecError, Window
from harness.criteria.cycle_time import check_cycle, cycle_time_within
from harness.criteria.dance import released_while_training, resident_while_asleep
from harness.criteria.delivered import delivered
from harness.criteria.memory import no_growth, returns_to_baseline
from harness.criteria.params import COMMON, NUMBER, Param, check_positive, param_value
from harness.criteria.replicas import replicas_agree
from harness.criteria.rise import check_rise, rise_by
from harness.criteria.versions import advances
from harness.run_data import RunData


@dataclass(frozen=True)
class Kind:
    """How a kind is judged (``evaluate``), the parameters its tables take, and its spec check."""

    evaluate: Callable[[Criterion, RunData], Result]
    params: Mapping[str, Param]
    check: Callable[[Criterion], None] | None = None


_PHASE = Param((str,), default="after_update_weights")
KINDS: dict[str, Kind] = {
    "band": Kind(band, {
        "lo": Param(NUMBER), "hi": Param(NUMBER), "reduce": Param((str,), default="each", choices=("each", "mean")),
        "n": Param((int,)), "lo_count": Param((int,)), "hi_count": Param((int,)),
    }, check_band),
    "rise_by": Kind(rise_by, {"min_rise": Param(NUMBER, required=True), "n": Param((int,)),
                              "min_rise_count": Param((int,))}, check_rise),
    "returns_to_baseline": Kind(returns_to_baseline, {
        "tolerance_gb": Param(NUMBER, required=True), "phase": _PHASE,
        "side": Param((str,), default="both", choices=("both", "above")), "baseline_gb": Param(NUMBER),
        "min_syncs": Param((int,), default=2),
    }, check_positive("tolerance_gb", "baseline_gb", "min_syncs")),
    "no_growth": Kind(no_growth, {"max_slope_gb_per_sync": Param(NUMBER, required=True), "phase": _PHASE,
                                  "min_points": Param((int,), default=5)}, check_positive("min_points")),
    "config_equals": Kind(config_equals, {"value": Param((str, int, float, bool), required=True)}),
    "cycle_time_within": Kind(cycle_time_within, {
        "lo": Param(NUMBER, required=True), "hi": Param(NUMBER, required=True),
        "unit": Param((str,), default="min", choices=("s", "min")), "allowed_outside": Param((int,), default=0),
    }, check_cycle),
    "completes_within": Kind(completes_within, {"max_minutes": Param(NUMBER, required=True),
                                                "min_rollouts": Param((int,), default=0)},
                             check_positive("max_minutes", "min_rollouts")),
    "advances": Kind(advances, {"step": Param((int,), default=1)}),
    "replicas_agree": Kind(replicas_agree, {"min_steps": Param((int,), default=1)}, check_positive("min_steps")),
    "delivered": Kind(delivered, {"min_syncs": Param((int,), default=1)}, check_positive("min_syncs")),
    "resident_while_asleep": Kind(resident_while_asleep, {
        "max_gb": Param(NUMBER, required=True), "before_phase": Param((str,), default="before_offload"),
        "after_phase": Param((str,), default="after_offload"), "min_syncs": Param((int,), default=2),
    }, check_positive("max_gb", "min_syncs")),
    "released_while_training": Kind(released_while_training, {
        "tag": Param((str,), default="weights"), "min_released_gb": Param(NUMBER),
        "min_rollouts": Param((int,), default=2),
    }, check_positive("min_released_gb", "min_rollouts")),
}


def evaluate(criterion: Criterion, run: RunData) -> Result:
    """One criterion's verdict on ``run`` as it is now."""
    return KINDS[criterion.kind].evaluate(criterion, run)


def evaluate_all(criteria: list[Criterion], run: RunData) -> list[Result]:
    """Each criterion's verdict on ``run``, in the spec's order."""
    return [evaluate(c, run) for c in criteria]


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
    unknown = set(table) - COMMON - set(kind_spec.params)
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for kind {kind!r} "
                        f"(its fields: {', '.join(sorted(kind_spec.params)) or 'none'})")
    params: dict[str, Any] = {}
    for name, spec in kind_spec.params.items():
        if name in table:
            params[name] = param_value(where, name, spec, table[name])
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
