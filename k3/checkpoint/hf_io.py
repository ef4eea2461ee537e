"""Reading and writing HF safetensors checkpoints: sharded files + ``model.safetensors.index.json``.

Everything here is layout only (no K3 math): resolve the index safely, iterate tensors shard by shard, and
write a sharded checkpoint while holding at most one shard in memory. Also the raw format itself: a validating
header reader and a streaming writer that never holds more than the caller's chunk, and output folders that are
built beside their target and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # torch is imported where tensors are made, so raw-file users (converter workers) stay light
    import torch

__all__ = [
    "CheckpointError",
    "INDEX_NAME",
    "TEXT_PREFIX",
    "read_config_json",
    "read_weight_map",
    "shard_files",
    "iter_shard_tensors",
    "load_state_dict",
    "ShardedWriter",
    "parse_size",
    "tensor_nbytes",
    "SAFETENSORS_ITEMSIZE",
    "SafetensorsEntry",
    "SafetensorsHeader",
    "read_safetensors_header",
    "SafetensorsStreamWriter",
    "safetensors_header",
    "check_output_dir",
    "commit_output_dir",
    "fsync_dir",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TEXT_PREFIX = "language_model."


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or inconsistent (the message names which)."""


def _safe_child(root: Path, rel: str, what: str) -> Path:
    """``root/rel`` if it stays inside ``root`` (no absolute paths, no ``..`` escapes)."""
    if not isinstance(rel, str) or not rel:
        raise CheckpointError(f"{what}: shard name {rel!r} is not a file name")
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise CheckpointError(f"{what}: shard path {rel!r} is absolute; it must be relative to {root}")
    p = (root / rel).resolve()
    if root.resolve() not in p.parents:
        raise CheckpointError(f"{what}: shard path {rel!r} escapes the model directory {root}")
    return p


def read_config_json(model_dir: str | Path) -> tuple[Path, dict]:
    """``(path, contents)`` of ``model_dir``'s ``config.json``. Raises ``CheckpointError`` naming what is wrong: not
    a directory, no ``config.json``, not readable JSON, not a JSON object."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{root} has no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return path, raw


def read_weight_map(model_dir: str | Path) -> dict[str, str]:
    """``{tensor name: shard file name}`` from the index (or the single ``model.safetensors``).

    Raises CheckpointError when the index is malformed, names a shard outside the directory, or a shard that
    does not exist.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    idx = root / INDEX_NAME
    if idx.exists():
        try:
            data = json.loads(idx.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{idx}: not valid JSON ({e})") from e
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{idx}: no 'weight_map' object")
        # Each shard path is resolved once, not once per tensor: full K3 names ~100k tensors in ~100 shards, and
        # resolving per tensor kept `k3 convert` silent for ~22 s before its progress bar.
        first_tensor = {}
        for name, shard in wm.items():
            if not isinstance(shard, str):
                _safe_child(root, shard, f"{idx} [{name}]")  # raises: not a file name
            first_tensor.setdefault(shard, name)
        for shard, name in first_tensor.items():
            p = _safe_child(root, shard, f"{idx} [{name}]")
            if not p.exists():
                raise CheckpointError(f"{idx}: tensor {name!r} is in shard {shard!r}, which does not exist")
        return dict(wm)
    single = root / SINGLE_NAME
    if single.exists():
        with _open(single) as f:
            return {k: SINGLE_NAME for k in f.keys()}
    raise CheckpointError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def shard_files(model_dir: str | Path) -> list[str]:
    """Shard file names in index order (sorted, as HF writes them)."""
    return sorted(set(read_weight_map(model_dir).values()))


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncation / bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def iter_shard_tensors(path: str | Path, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from one shard (all names, or just ``names``), each read on demand."""
    path = Path(path)
    with _open(path) as f:
        keys = list(f.keys()) if names is None else list(names)
        for k in keys:
            try:
                t = f.get_tensor(k)
            except Exception as e:
                raise CheckpointError(f"{path}: tensor {k!r} cannot be read ({e})") from e
            yield k, t


def load_state_dict(
    model_dir: str | Path, strip_prefix: str | None = TEXT_PREFIX, skip: re.Pattern | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, names with ``strip_prefix`` removed; names outside the prefix (the vision
    tower, the projector) and names matching ``skip`` are left out."""
    root = Path(model_dir)
    wm = read_weight_map(root)
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(by_shard):
        for name, t in iter_shard_tensors(root / shard, by_shard[shard]):
            if strip_prefix:
                if not name.startswith(strip_prefix):
                    continue
                name = name[len(strip_prefix):]
            if skip is not None and skip.search(name):
                continue
            out[name] = t
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.I)


def parse_size(s: str | int) -> int:
    """``"2GB"`` → 2e9 bytes, ``"512MiB"`` → 512·2^20, ints pass through."""
    if isinstance(s, int):
        return s
    m = _SIZE.match(str(s))
    if not m:
        raise ValueError(f"size {s!r}: expected a number with an optional unit like 2GB, 500MB, 1GiB")
    num, unit = float(m.group(1)), m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.replace("I", "").replace("B", "") or ""]
    return int(num * base**power)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class ShardedWriter:
    """Write tensors into ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size`` bytes.

    Holds at most one shard in memory; shards are first written as ``model-0000i.safetensors`` (the total is
    unknown while streaming) and renamed with ``-of-N`` in ``close()``, which also writes the index.
    """

    out_dir: Path
    max_shard_size: int = 2_000_000_000
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})
    _buf: dict[str, torch.Tensor] = field(default_factory=dict)
    _buf_bytes: int = 0
    _shards: list[tuple[str, list[str]]] = field(default_factory=list)
    _total: int = 0

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor_nbytes(tensor)
        if self._buf and self._buf_bytes + n > self.max_shard_size:
            self.flush()
        self._buf[name] = tensor.contiguous()
        self._buf_bytes += n
        self._total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buf:
            return
        tmp = f"model-{len(self._shards) + 1:05d}.safetensors"
        save_file(self._buf, str(self.out_dir / tmp), metadata=self.metadata)
        self._shards.append((tmp, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Flush, rename shards to ``-of-N``, write the index; returns the weight map."""
        self.flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / tmp, self.out_dir / final)
            for k in names:
                weight_map[k] = final
        index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


# ---------------------------------------------------------------------------------------------------------------
# Raw safetensors: header parsing with validation, and a streaming writer. A file is an 8-byte little-endian
# header length, a JSON header ({name: {dtype, shape, data_offsets}}, optional "__metadata__"), then the tensor
# bytes; offsets are relative to the end of the header and must tile the data exactly.

SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER_BYTES = 100_000_000  # the format's own limit


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    entries: dict[str, SafetensorsEntry]  # in file (offset) order
    metadata: dict[str, str] | None
    file_size: int


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header without reading tensor data.

    Raises CheckpointError naming the file (and tensor) when the file is truncated, the header is not valid JSON,
    an entry has an unknown dtype or a byte span that does not match its shape, or the offsets do not tile the data.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte "
                                      "header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: truncated or corrupt: header length {n} does not fit the file "
                                      f"({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header, not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header, expected a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointError(f"{path}: corrupt safetensors header, __metadata__ must map strings to strings")
    data_start = 8 + n
    entries: list[SafetensorsEntry] = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{where}: corrupt header entry {info!r}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: corrupt shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: corrupt data_offsets {offsets!r}")
        numel = 1
        for d in shape:
            numel *= d
        need = numel * SAFETENSORS_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != need:
            raise CheckpointError(f"{where}: corrupt: data_offsets span {offsets[1] - offsets[0]} bytes but "
                                  f"{dtype} {shape} needs {need}")
        entries.append(SafetensorsEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = data_start
    for e in entries:
        if e.begin != pos:
            raise CheckpointError(f"{path}: tensor {e.name!r}: corrupt: data starts at byte {e.begin}, expected "
                                  f"{pos} (tensors must tile the data without gaps or overlaps)")
        pos = e.end
    if pos > size:
        raise CheckpointError(f"{path}: truncated: the header describes {pos} bytes, the file has {size}")
    if pos < size:
        raise CheckpointError(f"{path}: corrupt: {size - pos} trailing bytes after the last tensor")
    return SafetensorsHeader(path, {e.name: e for e in entries}, metadata, size)


def safetensors_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None, where: str = ""
) -> tuple[bytes, list[tuple[str, int]]]:
    """The bytes before the data of a safetensors file holding ``tensors`` (``[(name, dtype, shape)]``, data in
    that order): the 8-byte length plus the JSON header padded to 8 bytes. Also returns ``[(name, nbytes)]``."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    sizes: list[tuple[str, int]] = []
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise CheckpointError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * SAFETENSORS_ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + nbytes]}
        sizes.append((name, nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw, sizes


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensor list is known up front, streaming each tensor's bytes in order.

    ``tensors`` is ``[(name, safetensors dtype, shape)]`` in file order. ``write(name, data)`` appends bytes to the
    current tensor (a tensor may arrive in several chunks); ``close()`` checks everything was written, fsyncs,
    and returns ``(size in bytes, CRC32 of the file as 8 hex digits, or None with checksum=False)``. On an
    exception inside ``with``, the file is removed. Memory: only the caller's chunk.

    CRC32, not SHA-256: the checksum guards against incomplete or damaged files, and on the 2-core dev machine
    SHA-256 cost ~0.8 CPU-s per GB, more than the MXFP4 decode, and halved the converter's throughput.
    """

    def __init__(self, path: str | Path, tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, checksum: bool = True) -> None:
        self.path = Path(path)
        raw, self._sizes = safetensors_header(tensors, metadata, where=str(self.path))
        self._crc: int | None = 0 if checksum else None
        self._file = open(self.path, "wb", buffering=0)
        self._size = 0
        self._emit(raw)
        self._current = 0
        self._left = self._sizes[0][1] if self._sizes else 0
        self._skip_empty()

    def _emit(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self._crc is not None:
            self._crc = zlib.crc32(mv, self._crc)
        while mv:  # raw file writes may be short
            n = self._file.write(mv)
            mv = mv[n:]
            self._size += n

    def _skip_empty(self) -> None:
        while self._current < len(self._sizes) and self._left == 0:
            self._current += 1
            self._left = self._sizes[self._current][1] if self._current < len(self._sizes) else 0

    def write(self, name: str, data) -> None:
        """Append ``data`` (bytes-like, numpy array or CPU tensor) to tensor ``name``, which must be the current one."""
        if self._current >= len(self._sizes):
            raise CheckpointError(f"{self.path}: tensor {name!r}: all tensors already written")
        expected = self._sizes[self._current][0]
        if name != expected:
            raise CheckpointError(f"{self.path}: tensor {name!r} written out of order; expected {expected!r}")
        torch = sys.modules.get("torch")  # a tensor implies torch is loaded
        if torch is not None and isinstance(data, torch.Tensor):
            data = data.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        n = memoryview(data).nbytes
        if n > self._left:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {n} bytes written, only {self._left} left")
        self._emit(data)
        self._left -= n
        self._skip_empty()

    def close(self) -> tuple[int, str | None]:
        if self._current < len(self._sizes):
            name = self._sizes[self._current][0]
            raise CheckpointError(f"{self.path}: closed with tensor {name!r} incomplete ({self._left} bytes missing)")
        os.fsync(self._file.fileno())
        self._file.close()
        return self._size, (f"{self._crc:08x}" if self._crc is not None else None)

    def abort(self) -> None:
        """Close and delete the partial file."""
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


# ---------------------------------------------------------------------------------------------------------------
# Output directories are built in a staging folder beside the target and renamed into place at the end, so a
# failure or a kill never leaves a half-written checkpoint at the target path.

def check_output_dir(out_dir: str | Path, overwrite: bool) -> None:
    """Raise CheckpointError if ``out_dir`` is a file, or a non-empty directory and ``overwrite`` is off."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out}: exists and is not empty; pass --overwrite to replace it")


def fsync_dir(path: str | Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_output_dir(staging: str | Path, out_dir: str | Path, overwrite: bool) -> None:
    """Move the finished ``staging`` folder to ``out_dir`` (replacing an existing one only with ``overwrite``)."""
    staging, out = Path(staging), Path(out_dir)
    check_output_dir(out, overwrite)
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.k3-replaced"
            if old.exists():
                shutil.rmtree(old)
            os.replace(out, old)
        else:
            out.rmdir()
    os.replace(staging, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)
