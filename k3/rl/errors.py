"""The error that ends a run: raised by the loop, the trainer group and the workers' callers."""

from __future__ import annotations

__all__ = ["TrainingError", "last_line"]


class TrainingError(RuntimeError):
    """The run cannot go on (a broken sync, an engine that does not serve the new adapter, …)."""


def last_line(error: BaseException) -> str:
    """The last non-blank line of ``error``'s text: what a one-line message keeps of a remote traceback (Ray puts
    the cause last)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
