"""What a trainer trains on: one rollout sample as a token sequence with its advantage and old log-probs.

A trajectory is ``prompt_ids + response_ids``; the model predicts response token ``j`` from position
``len(prompt) + j - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Trajectory"]


@dataclass
class Trajectory:
    """One sample to train on. ``advantage`` is per sample (GRPO); ``old_log_probs`` one per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    old_log_probs: list[float] | None = None
