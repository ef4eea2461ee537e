"""Handles on a run's workers (the trainer, each rollout engine) with one ``call`` facade, whether the worker is
an object in this process or a Ray actor; and one method on many handles at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LocalHandle", "RayHandle", "call_all", "submit"]


class LocalHandle:
    """An in-process worker ``obj`` behind the same ``call`` facade as a Ray actor's handle."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.obj, method)(*args)

    def has(self, method: str) -> bool:
        return callable(getattr(self.obj, method, None))


class RayHandle:
    """A worker running as the Ray actor ``actor``: ``call`` waits for the method's result."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def has(self, method: str) -> bool:
        return hasattr(self.actor, method)

    def submit(self, method: str, *args: Any) -> Callable[[], Any]:
        """Start ``method`` now; returns a function that waits for its result."""
        import ray

        ref = getattr(self.actor, method).remote(*args)
        return lambda: ray.get(ref)


def submit(handle: Any, method: str, *args: Any) -> Callable[[], Any]:
    """Start ``method`` on ``handle`` (at once on a Ray actor); returns a function that waits for the result.
    A handle without ``submit`` (in-process) runs it here and now."""
    start = getattr(handle, "submit", None)
    if start is not None:
        return start(method, *args)
    value = handle.call(method, *args)
    return lambda: value


def call_all(handles: Sequence[Any], method: str, *args: Any) -> list[Any]:
    """``method`` on every handle, all started before any is waited for; results in handle order."""
    pending = [submit(h, method, *args) for h in handles]
    return [wait() for wait in pending]
