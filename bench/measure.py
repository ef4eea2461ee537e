"""How the benches measure and report: one call's time on its device, and a result printed as its markdown table
and kept as JSON (``--out``). Imported by the bench scripts from their own folder (``python bench/<name>.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of ``fn`` in milliseconds: CUDA events around it on a GPU (its queued work included), else the
    wall clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def report(result: dict, table: str, out: Path | None) -> dict:
    """Print the markdown ``table``; write ``result`` as JSON to ``out`` when given (folders created)."""
    print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result
