"""The rollout engines a run can use, by name (``--rollout-engine``), registered once: an engine is a package
under ``k3/rollout/`` whose ``kind`` module defines its :class:`~k3.rollout.engine_kind.EngineKind`, listed here.

Cheap to import (no torch, no sglang): ``k3.launch.args`` takes the choices and the checks of its flags from here.
"""

from __future__ import annotations

from k3.rollout.embedded.kind import EmbeddedKind
from k3.rollout.engine_kind import EngineKind
from k3.rollout.sglang.kind import SGLangKind

__all__ = ["DEFAULT_ENGINE", "ENGINES", "ENGINE_NAMES", "engine_kind"]

ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (EmbeddedKind(), SGLangKind())}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)
DEFAULT_ENGINE = EmbeddedKind.name


def engine_kind(name: str) -> EngineKind:
    """The registered engine called ``name``; raises ``ValueError`` naming the registered ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout engine {name!r}: expected one of {', '.join(ENGINE_NAMES)}") from None
