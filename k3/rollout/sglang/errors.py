"""The SGLang engine's own errors (beside the protocol's, ``k3.rollout.errors``)."""

from __future__ import annotations

from k3.rollout.errors import EngineUnavailableError

__all__ = ["SGLangError", "SGLangUnavailableError"]


class SGLangUnavailableError(EngineUnavailableError):
    """sglang (or its GPU runtime) is not importable here."""


class SGLangError(RuntimeError):
    """SGLang refused a call or returned something this package cannot read; the message says what state remains."""
