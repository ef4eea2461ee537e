"""The report's figures: each series the criteria judge, with the criteria's bands drawn on it.

Every function takes the results of the criteria it draws (their numbers come from the criterion, their
verdicts colour the marks) and the run, and returns PNG bytes, or None when the run has nothing to draw.
matplotlib is imported here only (with the non-interactive Agg backend), so nothing else pays for it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

from harness.criteria import Result, Status
from harness.cycles import cycle_times
from harness.run_data import RunData, normalize_phase

__all__ = ["reward_figure", "eval_figure", "memory_figure", "cycle_figure", "PHASE_COLOURS"]

BAND = "#2e7d32"
FAIL = "#c62828"
LINE = "#1f4e79"
MUTED = "#9e9e9e"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return buffer.getvalue()


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 3.4))
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.25)
    _integer_x(ax)
    return fig, ax


def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _span(window: Any, xs: Sequence[float]) -> tuple[float, float]:
    last = window.last if window.last is not None else (max(xs) if xs else window.first)
    return window.first - 0.4, last + 0.4


def reward_figure(results: Sequence[Result], run: RunData) -> bytes | None:
    """Reward per rollout; each band criterion's band shaded over its window; means drawn dashed."""
    if not results:
        return None
    metric = next((m for r in results for m in r.criterion.metrics if run.series(m)), results[0].criterion.metric)
    series = run.series(metric)
    if not series:
        return None
    xs = sorted(series)
    ys = [series[i].value for i in xs]
    fig, ax = _axes(f"{metric} per rollout", "rollout", metric)
    for r in results:
        c = r.criterion
        lo = c["lo"] if c["lo"] is not None else min(ys)
        hi = c["hi"] if c["hi"] is not None else max(ys)
        x0, x1 = _span(c.window, xs)
        label = f"{c.id}: [{lo:g}, {hi:g}]" + (" (mean)" if c["reduce"] == "mean" else "")
        ax.fill_between([x0, x1], lo, hi, color=BAND, alpha=0.10 if c["reduce"] == "mean" else 0.22,
                        label=label, step="pre")
        if c["reduce"] == "mean" and "mean" in r.evidence:
            colour = FAIL if r.status is Status.FAIL else BAND
            ax.hlines(r.evidence["mean"], x0, x1, colors=colour, linestyles="--", label=f"mean {r.evidence['mean']:.3f}")
    ax.plot(xs, ys, marker="o", markersize=3, color=LINE, linewidth=1.2, label=metric)
    failing = [r.evidence["failing_index"] for r in results if r.status is Status.FAIL and "failing_index" in r.evidence]
    if failing:
        ax.plot(failing, [series[i].value for i in failing if i in series], "x", color=FAIL, markersize=10,
                mew=2, label="out of band")
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def eval_figure(results: Sequence[Result], run: RunData) -> bytes | None:
    """Eval accuracy per eval (x = the rollout it ran after), solved counts on the right axis, the band at the
    first eval and the rise target at the later one."""
    if not results:
        return None
    metric = next((m for r in results for m in r.criterion.metrics if run.series(m)), results[0].criterion.metric)
    series = run.series(metric)
    if not series:
        return None
    xs = sorted(series)
    ys = [series[i].value for i in xs]
    fig, ax = _axes(f"{metric} per eval", "rollout the eval ran after (0 = before training)", metric)
    n = next((r.criterion["n"] for r in results if r.criterion["n"]), None)
    for r in results:
        c = r.criterion
        if c.kind == "band":
            lo = c["lo"] if c["lo"] is not None else 0.0
            hi = c["hi"] if c["hi"] is not None else 1.0
            if n is not None and c["lo_count"] is not None:
                lo, hi = c["lo_count"] / n, c["hi_count"] / n  # the counts the printed band stands for
            x0, x1 = _span(c.window, xs)
            ax.fill_between([x0 - 0.6, x1 + 0.6], lo, hi, color=BAND, alpha=0.25,
                            label=f"{c.id}: {lo:.3f}–{hi:.3f}")
        elif c.kind == "rise_by" and "from_value" in r.evidence:
            start, end = r.evidence["from"], r.evidence["to"]
            base = r.evidence["from_value"]
            target = base + (c["min_rise_count"] / n if n and c["min_rise_count"] is not None else c["min_rise"])
            colour = FAIL if r.status is Status.FAIL else BAND
            ax.hlines(target, end - 1.5, end + 1.5, colors=colour, linestyles="--", linewidth=2,
                      label=f"{c.id}: target ≥ {target:.3f} at eval@{end}")
            ax.annotate("", xy=(end, series[end].value if end in series else target), xytext=(start, base),
                        arrowprops={"arrowstyle": "->", "color": colour, "alpha": 0.7})
    ax.plot(xs, ys, marker="o", color=LINE, linewidth=1.2, label=metric)
    ax.margins(y=0.2)
    if n is not None:
        right = ax.twinx()
        right.set_ylim(ax.get_ylim()[0] * n, ax.get_ylim()[1] * n)
        right.set_ylabel(f"solved of {n}")
        for x, y in zip(xs, ys):
            ax.annotate(f"{round(y * n)}/{n}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def _relative(syncs: dict) -> tuple[list[int], list[float], list[int], list[float]]:
    """A rank's readings relative to its baseline in their attempt (the first reading after the attempt's first
    optimizer step): (syncs, GB above) of the later readings, and of the startup ones."""
    base: dict[int, float] = {}
    for s in sorted(syncs):
        if not syncs[s].startup and syncs[s].attempt not in base:
            base[syncs[s].attempt] = syncs[s].value
    later = [(s, syncs[s].value - base[syncs[s].attempt]) for s in sorted(syncs)
             if not syncs[s].startup and syncs[s].attempt in base]
    startup = [(s, syncs[s].value - base[syncs[s].attempt]) for s in sorted(syncs)
               if syncs[s].startup and syncs[s].attempt in base]
    return [x for x, _ in later], [y for _, y in later], [x for x, _ in startup], [y for _, y in startup]


def memory_figure(results: Sequence[Result], run: RunData) -> bytes | None:
    """Per rank, memory after each sync relative to the rank's baseline (per attempt: the first sync after its
    first optimizer step), with the ±tolerance band and the startup syncs as open circles (judged only for not
    above); with an absolute-baseline criterion, a second panel of the values themselves."""
    relative = [r for r in results if r.criterion.kind in ("returns_to_baseline", "no_growth")
                and r.criterion.params.get("baseline_gb") is None]
    absolute = [r for r in results if r.criterion.kind == "returns_to_baseline"
                and r.criterion.params.get("baseline_gb") is not None]
    anchor = (relative or absolute or list(results))[:1]
    if not anchor:
        return None
    c0 = anchor[0].criterion
    phase = normalize_phase(c0["phase"])
    metric = next((m for m in c0.metrics if run.memory_series(phase, m)), c0.metric)
    by_rank = run.memory_series(phase, metric)
    if not by_rank:
        return None
    failing = {rank for r in results for rank in r.evidence.get("failing_ranks", [])}
    failing |= {rank for r in results for rank in r.evidence.get("growing_ranks", [])}
    plt = _pyplot()
    panels = 2 if absolute else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8.0, 3.4 * panels), squeeze=False)
    ax = axes[0][0]
    tolerance = next((r.criterion["tolerance_gb"] for r in relative if r.criterion.kind == "returns_to_baseline"),
                     None)
    syncs_all = sorted({s for syncs in by_rank.values() for s in syncs})
    if tolerance is not None and syncs_all:
        ax.fill_between([syncs_all[0] - 0.3, syncs_all[-1] + 0.3], -tolerance, tolerance, color=BAND, alpha=0.2,
                        label=f"baseline ± {tolerance:g} GB")
    startup_labelled = False
    for rank, syncs in sorted(by_rank.items()):
        xs, ys, sx, sy = _relative(syncs)
        colour, width, z = (FAIL, 1.6, 3) if rank in failing else (MUTED, 0.7, 2)
        ax.plot(xs, ys, color=colour, linewidth=width, alpha=0.8, zorder=z,
                label=f"rank {rank}" if rank in failing else None)
        if sx:
            ax.plot(sx, sy, "o", markerfacecolor="none", markeredgecolor=colour, markersize=4, zorder=z,
                    label=None if startup_labelled else "startup sync (judged: not above)")
            startup_labelled = True
    for attempt in run.attempts[1:]:
        first = min((s for syncs in by_rank.values() for s, p in syncs.items() if p.attempt == attempt.index),
                    default=None)
        if first is not None:
            ax.axvline(first - 0.5, color=LINE, linestyle=":", linewidth=1)
            ax.annotate(attempt.label, (first - 0.5, 1), xycoords=("data", "axes fraction"), fontsize=8,
                        xytext=(3, -10), textcoords="offset points")
    first = next((r.evidence for r in relative if "first_failing_rank" in r.evidence), None)
    if first is not None and "deviation_gb" in first and math.isfinite(first["deviation_gb"]):
        ax.plot([first["first_failing_sync"]], [first["deviation_gb"]], "x", color=FAIL, markersize=10, mew=2,
                label=f"first failure: rank {first['first_failing_rank']}, sync {first['first_failing_sync']}")
    ax.set_title(f"{metric} after each sync, relative to the rank's baseline ({len(by_rank)} ranks)",
                 fontsize=11, loc="left")
    ax.set_xlabel("sync")
    ax.set_ylabel("GB above baseline")
    ax.grid(True, alpha=0.25)
    _integer_x(ax)
    ax.legend(fontsize=8, loc="upper left")
    if absolute:
        ax2 = axes[1][0]
        c = absolute[0].criterion
        ax2.fill_between([syncs_all[0] - 0.3, syncs_all[-1] + 0.3], c["baseline_gb"] - c["tolerance_gb"],
                         c["baseline_gb"] + c["tolerance_gb"], color=BAND, alpha=0.2,
                         label=f"{c.id}: {c['baseline_gb']:g} ± {c['tolerance_gb']:g} GB")
        for rank, syncs in sorted(by_rank.items()):
            xs = sorted(syncs)
            colour, width = (FAIL, 1.6) if rank in failing else (MUTED, 0.7)
            ax2.plot(xs, [syncs[s].value for s in xs], color=colour, linewidth=width, alpha=0.8)
        ax2.set_title(f"{metric} after each sync (absolute)", fontsize=11, loc="left")
        ax2.set_xlabel("sync")
        ax2.set_ylabel("GB")
        ax2.grid(True, alpha=0.25)
        _integer_x(ax2)
        ax2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return _png(fig)


PHASE_COLOURS = {"generate": "#1f4e79", "offload": "#8e6c8a", "train": "#2e7d32", "onload": "#b07aa1",
                 "sync": "#ef6c00", "other": "#bdbdbd", "eval": "#ffffff"}


def _phase_panel(ax: Any, run: RunData, unit: str, scale: float) -> bool:
    """Each cycle stacked by phase (:func:`harness.phases.cycle_phases`), the eval after it hatched on top (not
    cycle time). False when the run timed no phase."""
    from harness.phases import PHASE_ORDER, cycle_phases

    phases = cycle_phases(run)
    if not phases:
        return False
    xs = sorted(phases)
    bottom = [0.0] * len(xs)
    for name in PHASE_ORDER:
        heights = [phases[i].get(name, 0.0) / scale for i in xs]
        if not any(heights):
            continue
        extra = {"hatch": "//", "edgecolor": MUTED} if name == "eval" else {}
        label = "eval (not cycle time)" if name == "eval" else name
        ax.bar(xs, heights, bottom=bottom, color=PHASE_COLOURS[name], label=label, width=0.8, **extra)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("each cycle by phase", fontsize=11, loc="left")
    ax.set_xlabel("cycle (rollout)")
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.25, axis="y")
    _integer_x(ax)
    ax.legend(fontsize=8, loc="upper left", ncol=4)
    return True


def cycle_figure(results: Sequence[Result], run: RunData) -> bytes | None:
    """Cycle time per rollout (eval excluded) with the band, cycles left out marked at the bottom; below it,
    each cycle stacked by phase when the run times its phases."""
    if not results:
        return None
    c = results[0].criterion
    scale = 60.0 if c["unit"] == "min" else 1.0
    times = cycle_times(run)
    if not times.cycles:
        return None
    xs = sorted(times.cycles)
    ys = [times.cycles[i].seconds / scale for i in xs]
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8.0, 6.4), squeeze=False)
    ax = axes[0][0]
    ax.set_title(f"rollout cycle time, eval excluded ({times.rule})", fontsize=11, loc="left")
    ax.set_xlabel("cycle (rollout)")
    ax.set_ylabel(c["unit"])
    ax.grid(True, alpha=0.25)
    _integer_x(ax)
    x0, x1 = _span(c.window, xs)
    ax.fill_between([x0, x1], c["lo"], c["hi"], color=BAND, alpha=0.2, label=f"[{c['lo']:g}, {c['hi']:g}] {c['unit']}")
    judged = [(x, y) for x, y in zip(xs, ys) if c.window.contains(x)]
    ax.plot(xs, ys, color=LINE, linewidth=1.0, alpha=0.6)
    ax.plot([x for x, _ in judged], [y for _, y in judged], "o", color=LINE, markersize=4, label="cycle")
    skipped = [(x, y) for x, y in zip(xs, ys) if not c.window.contains(x)]
    if skipped:
        ax.plot([x for x, _ in skipped], [y for _, y in skipped], "o", color=MUTED, markersize=4,
                label="not judged (outside the window)")
    outside = [(x, y) for x, y in judged if not (math.isfinite(y) and c["lo"] <= y <= c["hi"])]
    if outside:
        ax.plot([x for x, _ in outside], [y for _, y in outside], "x", color=FAIL, markersize=10, mew=2,
                label="outside the band")
    if times.excluded:
        bottom = min(ys + [c["lo"]]) * 0.98
        ax.plot(sorted(times.excluded), [bottom] * len(times.excluded), "^", color=MUTED,
                label="left out (eval of unknown length, or profiled)")
    r = results[0]
    if "median" in r.evidence:
        ax.axhline(r.evidence["median"], color=LINE, linestyle=":", label=f"median {r.evidence['median']:.2f}")
    finite = [y for y in ys if math.isfinite(y)]
    if finite:
        ax.set_ylim(min(min(finite), c["lo"]) * 0.9, max(max(finite), c["hi"]) * 1.08)
    ax.legend(fontsize=8, loc="lower right")
    if not _phase_panel(axes[1][0], run, c["unit"], scale):
        fig.delaxes(axes[1][0])
        fig.set_size_inches(8.0, 3.4)
    fig.tight_layout()
    return _png(fig)
