"""Folder helpers the checkpoint benches share: the bytes a folder holds, and reading it once into the page cache so
every timed run starts from the same state. Imported from the bench folder (``python bench/<name>.py``)."""

from __future__ import annotations

from pathlib import Path


def dir_bytes(d: Path) -> int:
    """Bytes of every file under ``d``."""
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def read_through(d: Path) -> None:
    """Read every file under ``d`` once (into the page cache)."""
    for p in sorted(d.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
