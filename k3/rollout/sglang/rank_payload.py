"""One engine rank's payload of one adapter chunk, made on the trainer rank that shares its GPU: the feed's
``make_payload`` (``k3.transport.rank_feed.RankFeed``) for an SGLang engine fed rank by rank.

It runs in the trainer's processes (the function travels in the engine's ``RankFeed``), on the rank's own bucket:
the bucket's bytes are the flattened bucket SGLang takes (one dtype, tensors back to back), so its ``uint8`` view
is serialized as it is, with no copy, by ``SGLangBackend.serialize_bucket``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.rollout.sglang.backend import SGLangBackend
from k3.rollout.sglang.payload import bucket_entries, tensor_checksums
from k3.transport.handoff import unflatten

__all__ = ["serialize_rank_payload"]


def serialize_rank_payload(bucket: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]],
                           with_checksums: bool) -> tuple[bytes, dict[str, str] | None]:
    """``(payload, checksums)`` of the chunk in ``bucket`` (1-D, contiguous, holding ``names`` with ``shapes``
    back to back): ``payload`` is SGLang's serialized flattened bucket over ``bucket``'s own memory (the caller
    keeps ``bucket`` alive until the engine has loaded it); ``checksums`` each tensor's SHA-256 when asked (what
    SGLang verifies on every rank with ``--check-weight-update-equal``), else None."""
    if bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(f"serialize_rank_payload: expected a 1-D contiguous bucket, got {tuple(bucket.shape)}")
    entries = bucket_entries(names, shapes, bucket.dtype)
    flat = bucket.view(torch.uint8)
    if entries and entries[-1].end != flat.numel():
        raise ValueError(f"serialize_rank_payload: the chunk's tensors need {entries[-1].end} bytes, the bucket "
                         f"holds {flat.numel()}")
    checksums = tensor_checksums(unflatten(bucket, names, shapes)) if with_checksums else None
    return SGLangBackend.serialize_bucket(flat, entries), checksums
