"""``k3 train``'s progress line: ``rollout N/total`` with the rate and an ETA, one plain line per rollout.

A plain line (not a redrawn bar) reads the same in a terminal and in a log file or ``kubectl logs``. The ETA
comes from this attempt's own pace (a resumed attempt does not count the killed one's rollouts): the seconds
since its first rollout began, over the rollouts it finished, times the rollouts left. Evals and checkpoint
saves between rollouts are part of that pace, as they are part of the wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["RolloutProgress", "format_duration"]


class RolloutProgress:
    """Progress of one attempt over rollouts ``0 … total - 1``; ``clock`` is in seconds (monotonic)."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1 rollout, got {total}")
        self.total = total
        self._clock = clock
        self._t0: float | None = None
        self._done = 0

    def begin(self, rollout_id: int) -> None:
        """Rollout ``rollout_id`` starts (the attempt's clock starts at its first)."""
        if self._t0 is None:
            self._t0 = self._clock()

    def finished(self, rollout_id: int, detail: str = "") -> str:
        """The line for rollout ``rollout_id`` just done: ``rollout 3/12: <detail> | 4.1 s/rollout, ETA 36s``
        (rollouts are counted from 1 in the line; ``rollout_id`` is 0-based)."""
        if self._t0 is None:
            raise RuntimeError("finished() before begin(): the attempt's clock never started")
        self._done += 1
        elapsed = self._clock() - self._t0
        pace = elapsed / self._done
        left = max(self.total - rollout_id - 1, 0)
        eta = "done" if left == 0 else f"ETA {format_duration(pace * left)}"
        head = f"rollout {rollout_id + 1}/{self.total}"
        return f"{head}: {detail} | {pace:.1f} s/rollout, {eta}" if detail else f"{head} | {pace:.1f} s/rollout, {eta}"


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: whole seconds, the two largest units."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
