"""Reading and writing HF safetensors checkpoints: sharded files + ``model.safetensors.index.json``.

Everything here is layout only (no K3 math): resolve the index safely, iterate tensors shard by shard, and
write a sharded checkpoint while holding at most one shard in memory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "CheckpointError",
    "INDEX_NAME",
    "TEXT_PREFIX",
    "read_weight_map",
    "shard_files",
    "iter_shard_tensors",
    "load_state_dict",
    "ShardedWriter",
    "parse_size",
    "tensor_nbytes",
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
        for name, shard in wm.items():
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
