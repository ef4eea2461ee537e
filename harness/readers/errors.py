"""Errors of the readers that stop a read (as opposed to a bad line, which is a reported problem)."""

from __future__ import annotations

__all__ = ["ReaderError", "ReaderUnavailable"]


class ReaderError(RuntimeError):
    """The source cannot be read at all (no such path, not a format the harness knows)."""


class ReaderUnavailable(ReaderError):
    """The source needs an optional package that is not installed (the message names it)."""
