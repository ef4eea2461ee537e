"""Digests of adapter tensors: an exact fingerprint computed on the tensor's own device, for the run-health
checks (replicas of a factor agree across ranks; the engine activated the chunks the trainer exported).

``tensor_digest`` hashes every element's bit pattern (no sampling: one flipped bit changes it) with integer
arithmetic only, so it is deterministic whatever the reduction order of the device: the bits are read as
integers, each is mixed with its position (a multiply-xorshift-multiply, wrapping in 64 bits) and the mixed
words are summed (mod 2**64). Two sums with different constants make a 128-bit digest. It is not a
cryptographic hash: it detects corruption, staleness and drift, not an adversary. Equal bits give equal
digests on every device; the digest also covers dtype and shape (``named_digest``, ``chunk_digest``).

Cost: a few elementwise passes over int64 words of the tensor (8 bytes per element of temporaries, one tensor at
a time) plus one small device-to-host copy per call; ``bench/lora_digest.py`` measures it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

__all__ = ["tensor_digest", "tensor_digests", "named_digest", "chunk_digest"]

# Odd 64-bit constants (splitmix64's), as signed int64: torch multiplies int64 with wrap-around.
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
_ADD = 0x632BE59BD9B4E019

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as int64 words of their bit patterns, flat (1-D)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    size = t.element_size()
    if size not in _INT_OF_SIZE:
        raise TypeError(f"tensor_digest: dtype {t.dtype} ({size} bytes per element) is not supported")
    return t.view(_INT_OF_SIZE[size]).to(torch.int64)


def _mixed_sums(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on ``t``'s device: the two position-mixed sums of its words."""
    w = _words(t)
    pos = torch.arange(w.numel(), dtype=torch.int64, device=w.device)
    x = (w + pos * _M1 + _ADD) * _M2
    x = x ^ torch.bitwise_right_shift(x, 31)
    y = x * _M3
    y = y ^ torch.bitwise_right_shift(y, 29)
    return torch.stack([x.sum(), y.sum()])


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """The digest of each tensor (32 hex digits each), with one device-to-host copy per device."""
    if not tensors:
        return []
    sums = [_mixed_sums(t) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    host: list[list[int]] = [[]] * len(sums)
    for idx in by_device.values():
        values = torch.stack([sums[i] for i in idx]).cpu().tolist()
        for i, v in zip(idx, values):
            host[i] = v
    return [f"{a & 0xFFFFFFFFFFFFFFFF:016x}{b & 0xFFFFFFFFFFFFFFFF:016x}" for a, b in host]


def tensor_digest(t: torch.Tensor) -> str:
    """The digest of one tensor's elements (32 hex digits); equal iff, with overwhelming probability, the bits
    are equal (dtype and shape are not covered: see ``named_digest``)."""
    return tensor_digests([t])[0]


def named_digest(name: str, t: torch.Tensor, digest: str | None = None) -> str:
    """``name|dtype|shape|elements`` as one line of text: what ``chunk_digest`` combines."""
    return f"{name}|{t.dtype}|{tuple(t.shape)}|{digest or tensor_digest(t)}"


def chunk_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One digest (SHA-256 hex) of an adapter chunk: its tensors' names, dtypes, shapes and elements, in the
    chunk's order. The trainer's export and the engine's activated adapter agree iff their chunks do."""
    items = list(named)
    digests = tensor_digests([t for _, t in items])
    h = hashlib.sha256()
    for (name, t), d in zip(items, digests):
        h.update(named_digest(name, t, d).encode())
        h.update(b"\n")
    return h.hexdigest()
