"""A chunk's bucket: its tensors back to back in one flat tensor, cut back into named views; its fingerprint;
and how buckets are shared (CPU sharing strategy, the device a bucket lives on, its copies finished)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import torch
import torch.multiprocessing as mp


def use_file_system_sharing() -> None:
    """Switch this process's CPU tensor sharing to ``file_system`` (see the module docstring for why)."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def flatten_into(bucket: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` back to back into the 1-D ``bucket``; returns the filled prefix (a view)."""
    numel = sum(t.numel() for t in tensors)
    if numel > bucket.numel():
        raise ValueError(f"bucket holds {bucket.numel()} elements, the chunk needs {numel}")
    prefix = bucket[:numel]
    torch.cat([t.reshape(-1) for t in tensors], out=prefix)
    return prefix


def flat_views(flat: torch.Tensor, shapes: Iterable[Sequence[int]]) -> list[torch.Tensor]:
    """Consecutive views of the 1-D ``flat`` with ``shapes``, in order (``flat`` must hold exactly their sum): the
    bucket layout, for a chunk written into its bucket (``export_chunks(..., out=)``) or read out of it."""
    views, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[at:at + n].view(*shape))
        at += n
    if at != flat.numel():
        raise ValueError(f"the chunk's tensors need {at} elements, its destination has {flat.numel()}")
    return views


def unflatten(bucket: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """``flat_views`` of ``bucket`` named by a received header (inverse of ``flatten_into``)."""
    need = sum(math.prod(shape) for shape in shapes)
    if need != bucket.numel():
        raise ValueError(f"bucket has {bucket.numel()} elements, the header's shapes need {need}")
    return list(zip(names, flat_views(bucket, shapes), strict=True))


def resolved_device(device: torch.device | str) -> torch.device:
    """``device`` with the current CUDA device's index where it names none: tensors report ``cuda:N``, and a bare
    ``cuda`` must compare equal to theirs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order: equal iff the adapters are bit-identical."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
