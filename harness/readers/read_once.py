"""Base of the readers of finished files (TensorBoard event files, a W&B offline run): the first ``read`` takes
everything there is, later reads add nothing (these formats are not followed live; the run directory is)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from harness.run_data import RunData

__all__ = ["ReadOnceSource"]


class ReadOnceSource(ABC):
    """Subclasses set ``kind`` and implement ``_open`` (what the read needs: a package, the file; raising
    ``ReaderUnavailable``/``ReaderError`` leaves the source unread, so a fixed setup can read it again) and
    ``_read_all`` (everything into ``run``)."""

    kind = "read-once"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._done = False

    def read(self, run: RunData, final: bool = False) -> int:
        """Read the whole source into ``run`` the first time; returns the number of events added (0 after)."""
        if self._done:
            return 0
        opened = self._open()
        self._done = True
        before = run.events
        self._read_all(run, opened)
        return run.events - before

    @abstractmethod
    def _open(self) -> Any:
        """What ``_read_all`` needs, or ``ReaderUnavailable``/``ReaderError`` (the source stays unread)."""

    @abstractmethod
    def _read_all(self, run: RunData, opened: Any) -> None:
        """Everything of the source into ``run``."""
