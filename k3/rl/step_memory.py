"""What one training step leaves allocated on the device (``--profile-train-step N``: step N + 1's, beside step N's
time profile).

A sleeping trainer pauses its torch_memory_saver regions; what stays on the device is the caching allocator's own
pool (``k3.transport.device_memory.default_pool_usage``). The first H100 smoke-gpu runs kept 1.44–1.46 GB there
after a training step and 0.08 GB before any: 0.57 GB of live blocks the size of a ``[tokens, 7168]`` BF16
activation, in 1.39 GB of segments those blocks keep from being returned. The readings say how much; this says
which code made it. The step runs with CUDA's allocator history recorded (Python stacks); afterwards every live
block of the default pool that the step allocated is attributed to the nearest frame of this repository's code or
of the libraries it drives (megatron, fla, torch's own Python), and the blocks are summed per frame.

It records the step after the profiled one, never the same step: on the H100 (torch 2.11), the history's Python
stacks under ``torch.profiler``'s Python tracer (``with_stack=True``) made an autograd Function's ``apply`` return
NULL without an exception, and the step failed with a SystemError.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from k3.transport.device_memory import DEFAULT_POOL

__all__ = ["HISTORY_ENTRIES", "left_allocated", "left_allocated_text", "record_step_memory", "write_step_memory"]

T = TypeVar("T")
HISTORY_ENTRIES = 200_000  # allocator events kept; older ones drop out (their blocks then show no frames)
SHOWN = 12  # frames listed, most bytes first
MB = 2**20
# The frame a block is attributed to: the innermost one in this repository, else in a library it drives.
OURS = re.compile(r"(?:^|/)((?:k3|bench)/[^\s]*)$")
LIBRARIES = re.compile(r"(?:^|/)((?:megatron|fla|torch_memory_saver|torch)/[^\s]*)$")
SELF = "k3/rl/step_memory.py"


def _where(frames: list[dict[str, Any]]) -> str:
    """``path:line (function)`` of the frame a block is attributed to (module docstring; failing both, the innermost
    Python frame, by its last two path parts); frames are innermost first, as the allocator records them."""
    for pattern in (OURS, LIBRARIES):
        for f in frames:
            found = pattern.search(str(f.get("filename", "")))
            if found and not found.group(1).startswith(SELF):
                return f"{found.group(1)}:{f.get('line', '?')} ({f.get('name', '?')})"
    for f in frames:
        path = str(f.get("filename", ""))
        if path.endswith(".py") and not path.endswith(SELF):
            return f"{'/'.join(path.split('/')[-2:])}:{f.get('line', '?')} ({f.get('name', '?')})"
    return "(no Python frame recorded)"


def left_allocated(snapshot: dict[str, Any], device_index: int = 0) -> dict[str, Any]:
    """Of ``torch.cuda.memory._snapshot()`` output taken after a step recorded with history: the default pool's
    segments on ``device_index``, their live blocks, and those the step allocated (a block with recorded frames),
    summed per frame. Sizes in MiB. ``{"reserved_mb", "live_mb", "made_in_step_mb", "made_in_step_blocks", "by_frame":
    [{"where", "mb", "blocks", "largest_mb"}, ...]}``, most bytes first, at most :data:`SHOWN` frames (the rest
    summed as ``"(other frames)"``)."""
    segments = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device_index
                and tuple(s.get("segment_pool_id", DEFAULT_POOL)) == DEFAULT_POOL]
    live = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    made = [b for b in live if b.get("frames")]
    groups: dict[str, list[int]] = {}
    for b in made:
        groups.setdefault(_where(b["frames"]), []).append(int(b["size"]))
    rows = sorted(({"where": w, "mb": sum(s) / MB, "blocks": len(s), "largest_mb": max(s) / MB}
                   for w, s in groups.items()), key=lambda r: (-r["mb"], r["where"]))
    if len(rows) > SHOWN:
        rest = rows[SHOWN - 1:]
        rows = rows[:SHOWN - 1] + [{"where": "(other frames)", "mb": sum(r["mb"] for r in rest),
                                    "blocks": sum(r["blocks"] for r in rest),
                                    "largest_mb": max(r["largest_mb"] for r in rest)}]
    return {"reserved_mb": sum(int(s["total_size"]) for s in segments) / MB,
            "live_mb": sum(int(b["size"]) for b in live) / MB,
            "made_in_step_mb": sum(int(b["size"]) for b in made) / MB,
            "made_in_step_blocks": len(made), "by_frame": rows}


def record_step_memory(fn: Callable[[], T]) -> tuple[T, dict[str, Any] | None]:
    """``fn()`` with the allocator's history recorded, and :func:`left_allocated` of the current device after it
    (garbage collected first, so only what is still referenced counts); None for the second on a machine without
    CUDA. A diagnostic never fails the step: if the allocator cannot record or be read, the second is ``{"error":
    "..."}`` and the step's result stands. ``fn``'s own exceptions propagate, the history switched off."""
    if not torch.cuda.is_available():
        return fn(), None
    try:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    except Exception as e:  # noqa: BLE001 - see the docstring
        return fn(), {"error": f"the allocator's history could not be recorded: {type(e).__name__}: {e}"}
    try:
        result = fn()
    except BaseException:
        _stop_history()
        raise
    try:
        torch.cuda.synchronize()
        gc.collect()
        found = left_allocated(torch.cuda.memory._snapshot(), torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001 - see the docstring
        found = {"error": f"the allocator could not be read: {type(e).__name__}: {e}"}
    stopped = _stop_history()
    if stopped is not None:
        found = {**found, "error": stopped}
    return result, found


def _stop_history() -> str | None:
    """Switch the history off; what went wrong, if anything."""
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the step is done
        return f"the allocator's history could not be switched off: {type(e).__name__}: {e}"
    return None


def left_allocated_text(found: dict[str, Any]) -> str:
    """:func:`left_allocated` output as lines a person reads (for the step's profile text)."""
    if "by_frame" not in found:
        return f"left allocated in the default pool after the step: not recorded ({found.get('error', 'no data')})\n"
    lines = [f"left allocated in the default pool after the step: {found['live_mb']:.1f} MiB live in "
             f"{found['reserved_mb']:.1f} MiB of segments; {found['made_in_step_mb']:.1f} MiB in "
             f"{found['made_in_step_blocks']} blocks made during the step, by where they were allocated:", "",
             f"{'MiB':>10} {'blocks':>7} {'largest':>9}  where"]
    lines += [f"{r['mb']:10.1f} {r['blocks']:7d} {r['largest_mb']:9.1f}  {r['where']}" for r in found["by_frame"]]
    return "\n".join(lines) + "\n"


def write_step_memory(found: dict[str, Any], folder: Path, name: str, title: str) -> Path:
    """Write :func:`left_allocated` output (or its ``{"error"}``) to ``<folder>/<name>.json`` and ``.txt``, the text
    headed by ``title``; returns the text file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(found, indent=1) + "\n")
    text = folder / f"{name}.txt"
    text.write_text(f"{title}\n\n{left_allocated_text(found)}")
    return text
