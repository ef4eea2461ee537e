"""A test-only stand-in for the pinned SGLang (0.5.23), for driving the real ``k3.rollout.sglang`` package and the
real loop on CPU. It has SGLang's module paths and, for every name ``k3.rollout.sglang.surface.SGLANG_SURFACE`` uses,
SGLang's signature (``tests/unit/test_loop_sglang.py`` compares them with the wheel's source). Behind them, the
engine generates with the tiny K3 reference model and applies the adapters it is sent, so a loop run on it is a
real run; it is strict where SGLang is fatal or silently wrong (resuming a region that was never released,
serving an adapter that is not complete, calls from another thread than the one that owns its event loop).

Put ``tests/fake_sglang`` first on ``sys.path`` (or pass it as ``--sglang-path``). Every call is appended to
:data:`TIMELINE` as ``(source, call, details)``; :data:`ENGINES` lists the engines made.
"""

from typing import Any

__version__ = "0.5.23"

TIMELINE: list[tuple[str, str, dict[str, Any]]] = []
ENGINES: list[Any] = []


def record(source: str, call: str, **details: Any) -> None:
    TIMELINE.append((source, call, details))
