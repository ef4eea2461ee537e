"""Tail-follow a growing text file by byte offset: whole lines only, a partial last line kept for later.

A writer flushes one whole line per event, but a reader may look between two ``write`` calls of a long line (or
while the OS has only part of it on disk). So a line without its ``\\n`` is held back until the next read; it
becomes an error only when the caller says the file is complete (``final=True``) — then it is handed over as
``partial`` for the reader to judge (a finished log may simply lack its last newline).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Line", "LineFollower"]


@dataclass(frozen=True)
class Line:
    number: int  # 1-based line number in the file
    text: str  # without the trailing newline
    partial: bool = False  # the file ended without a newline after this text


class LineFollower:
    """Yields the lines appended to ``path`` since the previous :meth:`read` (the file may not exist yet)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0  # bytes consumed (always at a line boundary)
        self.line_number = 0  # lines consumed
        self._pending = b""  # bytes of an incomplete last line

    def read(self, final: bool = False) -> list[Line]:
        """New complete lines; with ``final=True`` also the incomplete last line, marked ``partial``."""
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < self.offset + len(self._pending):
                    raise RuntimeError(f"{self.path}: the file shrank from {self.offset + len(self._pending)} "
                                       f"to {size} bytes while being followed (rotated or rewritten?)")
                f.seek(self.offset + len(self._pending))
                data = self._pending + f.read()
        except FileNotFoundError:
            return []
        *complete, rest = data.split(b"\n")
        lines = []
        for raw in complete:
            self.line_number += 1
            self.offset += len(raw) + 1
            lines.append(Line(self.line_number, _decode(raw)))
        self._pending = rest
        if final and rest:
            self.line_number += 1
            self.offset += len(rest)
            self._pending = b""
            lines.append(Line(self.line_number, _decode(rest), partial=True))
        return lines


def _decode(raw: bytes) -> str:
    # A log may carry stray bytes (a killed process mid-write); keep the line readable instead of failing.
    return raw.decode("utf-8", errors="replace").rstrip("\r")
