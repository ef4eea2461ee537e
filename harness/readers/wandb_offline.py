"""W&B offline runs (``wandb/offline-run-*/run-*.wandb``), read without a network and without syncing.

A ``.wandb`` file is a 7-byte header (``:W&B``, magic ``0xBEE1``, version 0) followed by LevelDB-log style
framing: 32 KiB blocks of chunks, each ``crc32c (4) | length (2, little-endian) | type (1)`` then the bytes
(type 1 = a whole record, 2/3/4 = first/middle/last piece). Each record is a protobuf ``Record`` of the
installed ``wandb`` package. From it the reader takes:

- ``history`` rows: every numeric key. The recipe logs ``rollout/*`` and ``perf/*`` against the step key
  ``rollout/step`` and ``eval/*`` against ``eval/step`` (both the rollout id), so those give the index;
  a row without them falls back to ``_step``.
- the run's ``config`` (the recipe passes its resolved arguments): config lines.

The framing checksums are not verified (no crc32c in the standard library); a chunk that does not frame or a
record that does not parse is reported and skipped. ``wandb`` is optional: without it this reader raises
:class:`ReaderUnavailable`.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from harness.readers.errors import ReaderError, ReaderUnavailable
from harness.readers.read_once import ReadOnceSource
from harness.run_data import ConfigEntry, Point, RunData, config_text

__all__ = ["WandbOfflineSource", "is_wandb_offline", "find_wandb_file"]

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK_SIZE = 32768
CHUNK_HEADER = struct.Struct("<IHB")  # crc32c, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
STEP_KEYS = {"eval/": "eval/step"}  # metric prefix -> its step key; everything else uses rollout/step
DEFAULT_STEP_KEY = "rollout/step"


def find_wandb_file(path: Path) -> Path | None:
    """The ``.wandb`` file of ``path`` (the file, an ``offline-run-*`` dir, or a ``wandb/`` dir with one run)."""
    if path.is_file():
        return path if path.suffix == ".wandb" else None
    if not path.is_dir():
        return None
    own = sorted(path.glob("run-*.wandb"))
    if own:
        return own[0]
    latest = path / "latest-run"
    if latest.exists():
        found = sorted(latest.glob("run-*.wandb"))
        if found:
            return found[0]
    runs = sorted(path.glob("offline-run-*/run-*.wandb"))
    if len(runs) > 1:
        raise ReaderError(f"{path}: {len(runs)} W&B offline runs here; name one: "
                          + ", ".join(str(r.parent) for r in runs))
    return runs[0] if runs else None


def is_wandb_offline(path: Path) -> bool:
    try:
        return find_wandb_file(path) is not None
    except ReaderError:
        return True  # it is one; open_source reports the ambiguity


class WandbOfflineSource(ReadOnceSource):
    """Reads one W&B offline run once; later reads add nothing."""

    kind = "wandb"

    def _open(self) -> tuple[Any, Path]:
        try:
            from wandb.proto import wandb_internal_pb2
        except ImportError as e:
            raise ReaderUnavailable(f"{self.path}: reading W&B offline runs needs the 'wandb' package "
                                    f"(pip install wandb): {e}") from None
        file = find_wandb_file(self.path)
        if file is None:
            raise ReaderError(f"{self.path}: no run-*.wandb file here")
        return wandb_internal_pb2, file

    def _read_all(self, run: RunData, opened: tuple[Any, Path]) -> None:
        wandb_internal_pb2, file = opened
        for number, payload in enumerate(_records(run, file), 1):
            where = f"{file.name}:record {number}"
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(payload)
            except Exception as e:  # protobuf's DecodeError; a cut or corrupted record
                run.problem(where, f"not a W&B record ({e}); skipped")
                continue
            kind = record.WhichOneof("record_type")
            if kind == "history":
                self._history(run, where, record.history.item)
            elif kind == "run":
                self._config(run, where, record.run.config.update)
            elif kind == "config":
                self._config(run, where, record.config.update)

    def _history(self, run: RunData, where: str, items: Any) -> None:
        row: dict[str, Any] = {}
        for item in items:
            key = item.key or "/".join(item.nested_key)
            try:
                row[key] = json.loads(item.value_json)
            except json.JSONDecodeError:
                run.problem(where, f"history value of {key!r} is not JSON; skipped")
        time = row.get("_timestamp")
        seq = run.begin_event()
        for key, value in row.items():
            if key.startswith("_") or key.endswith("/step") or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)):
                if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
                    value = float(value)
                else:
                    continue
            step_key = next((s for prefix, s in STEP_KEYS.items() if key.startswith(prefix)), DEFAULT_STEP_KEY)
            step = row.get(step_key, row.get("_step"))
            if not isinstance(step, (int, float)) or step < 0:
                run.problem(where, f"{key}: no step ({step_key} or _step); skipped")
                continue
            if not math.isfinite(float(value)):
                run.problem(where, f"{key} at step {int(step)} is {value}")
            run.add(Point(key, int(step), float(value), seq, where, float(time) if isinstance(time, (int, float)) else None))

    def _config(self, run: RunData, where: str, items: Any) -> None:
        seq = run.begin_event()
        for item in items:
            key = item.key or "/".join(item.nested_key)
            if key.startswith("_"):
                continue
            try:
                value = json.loads(item.value_json)
            except json.JSONDecodeError:
                run.problem(where, f"config value of {key!r} is not JSON; skipped")
                continue
            if isinstance(value, dict) and set(value) <= {"value", "desc"} and "value" in value:
                value = value["value"]  # the config.yaml form {value: …, desc: …}
            run.add(ConfigEntry(key, config_text(value), seq, where))


def _records(run: RunData, file: Path) -> list[bytes]:
    """The record payloads of a ``.wandb`` file, reassembled from their chunks."""
    data = file.read_bytes()
    if not data.startswith(HEADER):
        raise ReaderError(f"{file}: not a W&B transaction log (header {data[:7]!r})")
    records, pieces, pos = [], b"", len(HEADER)
    while pos < len(data):
        room = BLOCK_SIZE - pos % BLOCK_SIZE
        if room < CHUNK_HEADER.size:  # the tail of a block too short for a chunk header is zero padding
            pos += room
            continue
        if pos + CHUNK_HEADER.size > len(data):
            run.problem(f"{file.name}:byte {pos}", "file ends inside a chunk header (truncated); the rest is skipped")
            break
        _crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        pos += CHUNK_HEADER.size
        if kind == 0 and length == 0:  # preallocated zeros
            continue
        if pos + length > len(data) or length > room - CHUNK_HEADER.size:
            run.problem(f"{file.name}:byte {pos}", f"chunk of {length} bytes runs past the end of the file or "
                        "its block (truncated or corrupt); the rest is skipped")
            break
        chunk = data[pos:pos + length]
        pos += length
        if kind == FULL:
            records.append(chunk)
            pieces = b""
        elif kind == FIRST:
            pieces = chunk
        elif kind == MIDDLE:
            pieces += chunk
        elif kind == LAST:
            records.append(pieces + chunk)
            pieces = b""
        else:
            run.problem(f"{file.name}:byte {pos - length}", f"unknown chunk type {kind}; skipped")
    return records
