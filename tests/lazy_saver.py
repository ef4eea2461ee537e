"""A stand-in for torch_memory_saver's singleton that keeps its initialisation rules (tests only; no CUDA)."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator


class LazySaver:
    """torch_memory_saver 0.0.10's singleton as far as its initialisation goes: the hook mode may be set only before
    the first call that initialises it (``retain_cpu_backup`` and ``region`` do), after which setting it raises the
    AttributeError a smoke-gpu run met when the saver was initialised at load (megatron-core sets the hook mode when
    its inference contexts are imported, while the policy is built)."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict = {}
        self._impl = None
        self.retained = False
        self.regions: list[str] = []
        self.paused: list[str] = []

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        assert self._impl_ctor_kwargs is not None, "Cannot configure after initialization"
        self._impl_ctor_kwargs["hook_mode"] = mode

    def _ensure_initialized(self) -> None:
        if self._impl is None:
            self._impl = dict(self._impl_ctor_kwargs)
            del self._impl_ctor_kwargs

    @property
    def retain_cpu_backup(self) -> bool:
        self._ensure_initialized()
        return self.retained

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        self.retained = value

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        self._ensure_initialized()
        self.regions.append(tag)
        yield

    def pause(self, tag: str) -> None:
        self._ensure_initialized()
        self.paused.append(tag)


def install_lazy_saver() -> LazySaver:
    """Make ``from torch_memory_saver import torch_memory_saver`` give a fresh :class:`LazySaver` (this process)."""
    saver = LazySaver()
    sys.modules["torch_memory_saver"] = types.SimpleNamespace(torch_memory_saver=saver)
    return saver
