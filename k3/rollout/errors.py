"""The errors every rollout engine raises under the protocol (``k3.rollout.protocol``), whichever engine it is."""

from __future__ import annotations

__all__ = ["AdapterVersionError", "EngineStateError", "EngineUnavailableError"]


class EngineStateError(RuntimeError):
    """The engine was asked to do something its memory state does not allow (e.g. generate while released)."""


class AdapterVersionError(ValueError):
    """An adapter version was incomplete, out of order or not newer than the active one; nothing was applied."""


class EngineUnavailableError(ImportError):
    """The engine's runtime cannot be used on this machine (not installed, or no GPU runtime); the message says
    how to get it or which engine to use instead."""
