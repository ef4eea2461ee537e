"""The bucket an adapter chunk travels to SGLang in: SGLang's flattened-bucket layout (one flat ``uint8`` tensor
plus per-tensor byte ranges), its inverse, the object SGLang's worker deserializes, and the checksums SGLang
verifies."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BucketEntry", "bucket_entries", "build_lora_payload", "sglang_bucket_payload", "tensor_checksums",
           "unflatten_lora_payload"]


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a flattened bucket: bytes ``[start, end)`` of the flat ``uint8`` tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _named_tensors(chunk: Any) -> list[tuple[str, torch.Tensor]]:
    named = chunk.tensors if hasattr(chunk, "tensors") else chunk
    return list(named)


def build_lora_payload(chunk: Any) -> tuple[torch.Tensor, list[BucketEntry]]:
    """Flatten an ``AdapterChunk`` (or a list of ``(name, tensor)``) into SGLang's flattened-bucket layout.

    Returns ``(flat, entries)``: ``flat`` is 1-D ``uint8`` on the tensors' device, [total bytes], each tensor's
    bytes back to back in chunk order (a tensor starts on a multiple of its element size, so only a dtype
    change can leave padding); ``entries[i]`` says where tensor ``i`` lies. Inverse:
    :func:`unflatten_lora_payload`.
    """
    named = _named_tensors(chunk)
    if not named:
        raise ValueError("build_lora_payload: the chunk has no tensors")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"build_lora_payload: tensor names repeat in one chunk: {dup}")
    devices = {t.device for _, t in named if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"build_lora_payload: the chunk's tensors lie on several devices {sorted(map(str, devices))}")
    parts: list[torch.Tensor] = []
    entries: list[BucketEntry] = []
    offset = 0
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"build_lora_payload: {name} is a {type(t).__name__}, expected a torch.Tensor")
        if not t.is_floating_point():
            raise ValueError(f"build_lora_payload: {name} has dtype {t.dtype}; adapter factors are floating point")
        pad = -offset % t.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        entries.append(BucketEntry(name, tuple(t.shape), t.dtype, offset, offset + raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    return torch.cat(parts), entries


def bucket_entries(names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[BucketEntry]:
    """Where each tensor of a hand-off bucket lies in its bytes: the bucket holds ``names`` with ``shapes``, all of
    ``dtype``, back to back (``k3.transport.handoff.flatten_into``), so its ``uint8`` view is a flattened bucket
    with these entries and needs no copy."""
    if len(names) != len(shapes):
        raise ValueError(f"bucket_entries: {len(names)} names for {len(shapes)} shapes")
    entries, offset = [], 0
    for name, shape in zip(names, shapes):
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= int(dim)
        entries.append(BucketEntry(name, tuple(int(d) for d in shape), dtype, offset, offset + nbytes))
        offset += nbytes
    return entries


def unflatten_lora_payload(flat: torch.Tensor, entries: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the named tensors ``entries`` describe (what SGLang's bucket reconstructs)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"unflatten_lora_payload: expected a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    end = 0
    for e in entries:
        size = e.dtype.itemsize
        for dim in e.shape:
            size *= dim
        if e.start < end or e.end > flat.numel() or e.nbytes != size or e.start % e.dtype.itemsize:
            raise ValueError(f"unflatten_lora_payload: {e.name}: bytes [{e.start}, {e.end}) do not fit a "
                             f"{flat.numel()}-byte bucket after byte {end} as {e.dtype} {e.shape}")
        out.append((e.name, flat[e.start:e.end].view(e.dtype).reshape(e.shape)))
        end = e.end
    return out


def sglang_bucket_payload(flat: torch.Tensor, entries: Sequence[BucketEntry], metadata_cls: type) -> dict[str, Any]:
    """The object SGLang's worker deserializes for ``load_format="flattened_bucket"``: the flat tensor and one
    ``metadata_cls`` (SGLang's ``FlattenedTensorMetadata``) per tensor, byte offsets as SGLang counts them."""
    return {
        "flattened_tensor": flat,
        "metadata": [metadata_cls(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start,
                                  end_idx=e.end, numel=e.nbytes) for e in entries],
    }


def tensor_checksums(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes, as SGLang's worker computes them to verify a received adapter."""
    return {name: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            .hexdigest() for name, t in named}
