"""Where one training step's time goes: the step run under ``torch.profiler`` and summarised (``--profile-train-step``).

The summary is the step's most expensive kernels (on CUDA; the CPU operators without one), each with the operators
that launched it, their input shapes and the nearest frame of this repository's code, so that a slow kernel names
the line to fix. The first H100 smoke-gpu run needed exactly that: 77% of a step in one cuBLAS kernel, which the
kernel name alone did not tie to ``o_proj`` (docs/PERFORMANCE.md, "The Megatron training step on the GPU").

Written per rank as ``<name>.json`` (every number) and ``<name>.txt`` (the table a person reads), under the run's
``profile/`` folder. What the next step leaves allocated is ``k3.rl.step_memory``'s.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["PROFILE_DIR", "PROFILED_STEP", "profile_call", "summary_text", "top_kernels", "write_profile"]

T = TypeVar("T")
PROFILE_DIR = "profile"  # under the run directory
PROFILED_STEP = "perf/profiled_step"  # on the train event of the rollout whose step was profiled (its index)
TRACED = 5  # the top entries whose launching operators are traced
LAUNCHERS_SHOWN = 3  # launchers listed per traced entry
# A frame of this repository's code: a path through k3/ or bench/ (absolute, or relative to the working directory)
REPO_FRAME = re.compile(r"(?:^|/)((?:k3|bench)/.*)")
SELF = "k3/rl/step_profile.py"  # the profiler's own frame names nothing
# The Python-function events with_stack records (any thread's, e.g. a test runner's reader blocked in read()):
# context for the operators, not operators themselves.
PYTHON_FRAME = re.compile(r"\.py\(\d+\): |^<built-in ")


def _repo_frame(event: Any) -> str:
    """The nearest frame of this repository's code above a profiled operator: from its recorded stack when the
    profiler attached one, else from the Python-function events it runs under (``path(line): function``)."""
    candidates = list(event.stack or [])
    parent = event.cpu_parent
    while parent is not None:
        candidates.append(parent.name)
        parent = parent.cpu_parent
    for frame in candidates:
        found = REPO_FRAME.search(frame)
        if found and not found.group(1).startswith(SELF):
            return found.group(1)
    return ""


def _launchers(prof: profile, names: set[str], unit: str, per_name: int = LAUNCHERS_SHOWN) -> dict[str, list[dict]]:
    """For each kernel (``unit`` cuda) or operator (cpu) in ``names``: the innermost operators that launched it, or
    the operator's own calls, grouped by input shapes and nearest repository frame, with the time each accounts
    for (ms), most first."""
    found: dict[str, dict[str, float]] = {}

    def note(name: str, e, ms: float) -> None:
        frame = _repo_frame(e)
        where = f"{e.name} {e.input_shapes}" + (f" at {frame}" if frame else "")
        found.setdefault(name, {})
        found[name][where] = found[name].get(where, 0.0) + ms

    for e in prof.events():
        if unit == "cuda":
            for k in getattr(e, "kernels", []):
                if k.name in names:
                    note(k.name, e, k.duration / 1e3)
        elif e.device_type == torch.autograd.DeviceType.CPU and e.name in names:
            note(e.name, e, e.self_cpu_time_total / 1e3)
    return {k: [{"ms": ms, "by": w} for w, ms in sorted(v.items(), key=lambda i: -i[1])[:per_name]]
            for k, v in found.items()}


def top_kernels(prof: profile, n: int) -> dict[str, Any]:
    """The ``n`` most expensive entries of a finished profile: CUDA kernels by device time when any ran, else CPU
    operators by self CPU time (Python-function events left out). ``{"unit": "cuda" | "cpu", "total_ms", "rows":
    [{"name", "calls", "ms", "share", "launched_by"}]}``; ``launched_by`` is filled for the top :data:`TRACED`."""
    averages = prof.key_averages()
    cuda = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    if cuda:
        rows = [(e.key, e.count, e.self_device_time_total / 1e3) for e in cuda]
        unit = "cuda"
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in averages
                if e.device_type == torch.autograd.DeviceType.CPU and not PYTHON_FRAME.search(e.key)]
        unit = "cpu"
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    launchers = _launchers(prof, {r[0] for r in rows[:TRACED]}, unit)
    return {"unit": unit, "total_ms": total,
            "rows": [{"name": name, "calls": calls, "ms": ms, "share": ms / total if total else 0.0,
                      "launched_by": launchers.get(name, [])} for name, calls, ms in rows[:n]]}


def profile_call(fn: Callable[[], T], top: int = 25) -> tuple[T, dict[str, Any]]:
    """``fn()`` under ``torch.profiler`` (CPU, and CUDA when available; shapes and stacks recorded): its result and
    :func:`top_kernels`' summary with ``wall_s``, the call's wall time (seconds, the device synchronized)."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return result, {"wall_s": wall, **top_kernels(prof, top)}


def summary_text(summary: dict[str, Any], title: str) -> str:
    """The summary as a table: one line per kernel (ms, share, calls, name), its launchers indented below."""
    lines = [f"{title}: {summary['wall_s']:.3f} s wall; {summary['total_ms']:.1f} ms of {summary['unit'].upper()} "
             f"time in all, the top {len(summary['rows'])} below", "",
             f"{'ms':>10} {'share':>7} {'calls':>7}  name"]
    for row in summary["rows"]:
        lines.append(f"{row['ms']:10.1f} {row['share']:7.1%} {row['calls']:7d}  {row['name'][:120]}")
        lines += [f"{'':27}{b['ms']:.1f} ms: {b['by'][:200]}" for b in row["launched_by"]]
    return "\n".join(lines) + "\n"


def write_profile(summary: dict[str, Any], folder: Path, name: str, title: str) -> Path:
    """Write ``<folder>/<name>.json`` and ``.txt``; returns the text file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = folder / f"{name}.txt"
    text.write_text(summary_text(summary, title))
    return text
