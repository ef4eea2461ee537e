"""The error that ends a run: raised by the loop, the trainer group and the workers' callers."""

from __future__ import annotations

__all__ = ["TrainingError"]


class TrainingError(RuntimeError):
    """The run cannot go on (a broken sync, an engine that does not serve the new adapter, …)."""
