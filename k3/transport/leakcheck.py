"""The leak gate: after every adapter sync, the producer's memory must be back at its baseline.

The recipe's health rule (§5.6): "trainer allocated memory returns to about its baseline after every weight
sync"; if it does not, the export leaks and the run dies hours later. ``LeakCheck`` turns that into checks
that run after each sync and name the first sync where memory did not return:

* **exported storages** — weakrefs to every storage the sync exported (chunk tensors, buckets) registered
  with ``track``; after the sync none may be alive;
* **shared-memory segments** — ``/dev/shm/torch_<this pid>_*`` files (CPU buckets under the ``file_system``
  sharing strategy, CUDA IPC ref-counter files); after the sync the set must equal the baseline's;
* **CUDA** — ``torch.cuda.memory_allocated`` back within ``cuda_tolerance_bytes`` (1 MiB) of the baseline;
* **RSS** — no upward trend: the least-squares slope of RSS over syncs below ``rss_slope_limit_bytes``, and
  RSS not stuck above baseline + ``rss_tolerance_bytes`` from some sync to the end.

Take the baseline after one warm-up sync: the first sync creates things that stay on purpose (the receiver
connection, torch's shm manager, a persistent transfer buffer). ``memory_record`` gives the
``memory/allocated_gb`` metrics record the trainer logs before and after every sync.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

try:  # glibc only; elsewhere RSS is read as it is
    import ctypes

    _LIBC_MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _LIBC_MALLOC_TRIM = None


def release_freed_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim(0)``).

    glibc keeps pages that a training step's activations freed, so RSS stays at the step's high-water mark
    (measured: 0.34 GB live, 1.07 GB RSS after a tiny-K3 GRPO step). Trimmed, RSS is live memory again and
    "returns to baseline" means what it says on CPU, as ``memory_allocated`` does on CUDA."""
    if _LIBC_MALLOC_TRIM is not None:
        _LIBC_MALLOC_TRIM(0)

__all__ = ["LeakCheck", "LeakReport", "LeakError", "MemorySample", "least_squares_slope"]

_MiB = 1 << 20
_GB = 1024**3  # GiB: what the recipe's print_memory calls GB (docs/RUN_DIRECTORY.md)


class LeakError(AssertionError):
    """Memory did not return to the baseline after a sync; the message names the first such sync."""

    def __init__(self, report: "LeakReport") -> None:
        super().__init__(str(report))
        self.report = report


@dataclass(frozen=True)
class MemorySample:
    """Memory of this process at one moment. Sizes in bytes; ``cuda_allocated_bytes`` is None without CUDA."""

    time: float
    rss_bytes: int
    shm_segments: frozenset[str]
    cuda_allocated_bytes: int | None
    cuda_reserved_bytes: int | None
    live_tracked: int


@dataclass
class LeakReport:
    """Verdict over all syncs so far. ``first_bad_sync`` is None when every check passed."""

    syncs: int
    first_bad_sync: int | None
    problems: list[tuple[int, str]] = field(default_factory=list)
    rss_slope_bytes_per_sync: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        slope = f"RSS slope {self.rss_slope_bytes_per_sync / 1024:+.1f} KiB/sync"
        if self.ok:
            return f"leak gate PASS: {self.syncs} syncs, memory back at baseline after each ({slope})"
        lines = [f"leak gate FAIL: memory did not return to baseline, first at sync {self.first_bad_sync} "
                 f"({len(self.problems)} problems over {self.syncs} syncs, {slope})"]
        lines += [f"  sync {i}: {msg}" for i, msg in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"  ... {len(self.problems) - 20} more")
        return "\n".join(lines)


def least_squares_slope(ys: list[float]) -> float:
    """Slope of the least-squares line through ``(i, ys[i])``; 0 for fewer than two points."""
    n = len(ys)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(ys) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(ys))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


class LeakCheck:
    """Per-sync memory samples of this process against a baseline.

    Args:
        device: the CUDA device to watch (``memory_allocated``); None or a CPU device watches no CUDA memory.
        shm_dir, shm_prefix: where torch's shared-memory files live and the name prefix of this process's
            (default ``torch_<pid>_``: other processes on the machine have their own).
        rss_slope_limit_bytes: largest accepted RSS trend, bytes per sync.
        rss_tolerance_bytes: RSS above baseline by more than this from some sync to the end is a leak.
        cuda_tolerance_bytes: allowed ``memory_allocated`` excess over the baseline after a sync.
        collect_garbage: run ``gc.collect()`` before each sample. Off by default, which is the stricter
            gate: memory must come back by reference counting alone, because a chunk kept by a reference
            cycle holds its (CUDA IPC) storage until some later full collection (failure mode: IPC handle
            tables filling up on MoE updates). A full collection also costs ~0.1 s with torch loaded.

    Use: ``set_baseline()`` after a warm-up sync; per sync ``track(...)`` what it exports, then ``end_sync()``;
    finally ``check()`` (raises ``LeakError``) or ``report()``.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        shm_dir: str | Path = "/dev/shm",
        shm_prefix: str | None = None,
        rss_slope_limit_bytes: float = 256 * 1024,
        rss_tolerance_bytes: int = 32 * _MiB,
        cuda_tolerance_bytes: int = _MiB,
        collect_garbage: bool = False,
    ) -> None:
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.shm_dir = Path(shm_dir)
        self.shm_prefix = shm_prefix if shm_prefix is not None else f"torch_{os.getpid()}_"
        self.rss_slope_limit_bytes = rss_slope_limit_bytes
        self.rss_tolerance_bytes = rss_tolerance_bytes
        self.cuda_tolerance_bytes = cuda_tolerance_bytes
        self.collect_garbage = collect_garbage
        self.baseline: MemorySample | None = None
        self.samples: list[MemorySample] = []
        self._problems: list[tuple[int, str]] = []
        self._tracked: list[tuple[int, weakref.ref]] = []
        self._process = psutil.Process()

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    # ------------------------------------------------------------------ sampling
    def shm_segments(self) -> frozenset[str]:
        """This process's torch shared-memory files present now."""
        try:
            return frozenset(n for n in os.listdir(self.shm_dir) if n.startswith(self.shm_prefix))
        except FileNotFoundError:
            return frozenset()

    def live_tracked(self) -> dict[int, int]:
        """Tracked storages still alive, counted by the sync that exported them."""
        alive: dict[int, int] = {}
        for sync, ref in self._tracked:
            if ref() is not None:
                alive[sync] = alive.get(sync, 0) + 1
        return alive

    def snapshot(self) -> MemorySample:
        """Sample memory now (after a device sync, and ``gc.collect()`` when configured)."""
        if self.collect_garbage:
            gc.collect()
        allocated = reserved = None
        if self._cuda:
            torch.cuda.synchronize(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
        release_freed_heap()
        return MemorySample(
            time=time.time(),
            rss_bytes=self._process.memory_info().rss,
            shm_segments=self.shm_segments(),
            cuda_allocated_bytes=allocated,
            cuda_reserved_bytes=reserved,
            live_tracked=sum(self.live_tracked().values()),
        )

    def set_baseline(self) -> MemorySample:
        """Take the baseline (after a warm-up sync); clears earlier samples and tracked storages."""
        self._tracked.clear()
        self.samples.clear()
        self._problems.clear()
        self.baseline = self.snapshot()
        return self.baseline

    def track(self, obj: Any) -> None:
        """Register storages that must be gone after the current sync.

        ``obj``: a tensor, an object with ``.tensors`` (an adapter chunk), or an iterable of tensors or of
        ``(name, tensor)`` pairs.
        """
        sync = len(self.samples)
        for t in _tensors_of(obj):
            self._tracked.append((sync, weakref.ref(t.untyped_storage())))

    # ------------------------------------------------------------------ per sync
    def end_sync(self) -> list[str]:
        """Sample after a sync and check it against the baseline; returns this sync's problems (empty if clean)."""
        if self.baseline is None:
            raise RuntimeError("LeakCheck.end_sync before set_baseline(): take the baseline after a warm-up sync")
        index = len(self.samples)
        sample = self.snapshot()
        self.samples.append(sample)
        problems: list[str] = []
        alive = self.live_tracked()
        self._tracked = [(s, r) for s, r in self._tracked if r() is not None]
        if alive:
            where = ", ".join(f"{n} from sync {s}" for s, n in sorted(alive.items()))
            problems.append(f"{sum(alive.values())} exported storages still alive ({where})")
        extra = sorted(sample.shm_segments - self.baseline.shm_segments)
        if extra:
            problems.append(f"{len(extra)} shared-memory segments not in the baseline: {', '.join(extra[:4])}"
                            + (" ..." if len(extra) > 4 else ""))
        if self._cuda:
            excess = sample.cuda_allocated_bytes - self.baseline.cuda_allocated_bytes
            if excess > self.cuda_tolerance_bytes:
                problems.append(f"CUDA allocated {excess / _MiB:+.2f} MiB over baseline "
                                f"(tolerance {self.cuda_tolerance_bytes / _MiB:.2f} MiB)")
        self._problems += [(index, p) for p in problems]
        return problems

    # ------------------------------------------------------------------ verdict
    def report(self) -> LeakReport:
        """Every problem so far plus the RSS trend; ``first_bad_sync`` is the earliest sync with a problem."""
        problems = list(self._problems)
        rss = [s.rss_bytes for s in self.samples]
        slope = least_squares_slope([float(r) for r in rss])
        if self.baseline is not None and rss:
            base = self.baseline.rss_bytes
            stuck = _first_stuck_above(rss, base + self.rss_tolerance_bytes)
            if stuck is not None:
                problems.append((stuck, f"RSS stayed more than {self.rss_tolerance_bytes / _MiB:.0f} MiB above "
                                        f"baseline from here to the last sync ({(rss[-1] - base) / _MiB:+.1f} MiB at the end)"))
            if slope > self.rss_slope_limit_bytes:
                since = _first_unreturned_step(rss, base, self.rss_slope_limit_bytes)
                problems.append((since, f"RSS grows {slope / 1024:.1f} KiB per sync (limit "
                                        f"{self.rss_slope_limit_bytes / 1024:.1f} KiB); the growth starts here"))
        problems.sort(key=lambda p: p[0])
        first = problems[0][0] if problems else None
        return LeakReport(syncs=len(self.samples), first_bad_sync=first, problems=problems,
                          rss_slope_bytes_per_sync=slope)

    def check(self) -> LeakReport:
        """The report, or ``LeakError`` naming the first bad sync."""
        report = self.report()
        if not report.ok:
            raise LeakError(report)
        return report

    # ------------------------------------------------------------------ metrics
    def memory_record(self, phase: str, **extra: Any) -> dict[str, Any]:
        """A ``metrics.jsonl`` memory event for ``phase`` (e.g. ``before_update_weights``).

        ``memory/allocated_gb`` is ``torch.cuda.memory_allocated`` on a CUDA device and, on CPU, the process
        RSS (the closest CPU counterpart); ``memory/rss_gb`` is always the RSS. GB = 2**30 bytes.
        """
        s = self.snapshot()
        record: dict[str, Any] = {
            "time": s.time,
            "event": "memory",
            "phase": phase,
            "device": str(self.device) if self._cuda else "cpu",
            "memory/allocated_gb": (s.cuda_allocated_bytes if self._cuda else s.rss_bytes) / _GB,
            "memory/rss_gb": s.rss_bytes / _GB,
            "memory/shm_segments": len(s.shm_segments),
        }
        if self._cuda:
            record["memory/reserved_gb"] = s.cuda_reserved_bytes / _GB
        record.update(extra)
        return record


def _first_stuck_above(values: list[int], limit: float) -> int | None:
    """The first index from which every value to the end is above ``limit`` (None if the last is not)."""
    first = None
    for i in range(len(values) - 1, -1, -1):
        if values[i] > limit:
            first = i
        else:
            break
    return first


def _first_unreturned_step(values: list[int], base: int, step: float) -> int:
    """The first sync that added more than ``step`` bytes that were never given back (RSS never fell below
    the level before it + ``step`` again); the last sync if no single sync stands out."""
    levels = [base, *values]
    for i in range(len(values)):
        if levels[i + 1] - levels[i] > step and min(values[i:]) > levels[i] + step:
            return i
    return len(values) - 1


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if hasattr(obj, "tensors"):
        obj = obj.tensors
    for item in obj:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            yield item[1]
        else:
            raise TypeError(f"LeakCheck.track: cannot find a tensor in {type(item).__name__}")
