"""The protocol's sampling settings as SGLang's per-request ``sampling_params`` dicts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from k3.rollout.protocol import SamplingParams

__all__ = ["build_sampling_params"]


def build_sampling_params(sampling: SamplingParams, num_requests: int,
                          stop_token_ids: Iterable[int] = ()) -> list[dict[str, Any]]:
    """One SGLang ``sampling_params`` dict per request.

    Text is decoded like the embedded engine's (special tokens kept, the stop token not trimmed). A ``seed``
    gives request ``i`` the seed ``seed + i`` — identical prompts of a GRPO group must not share one — and
    SGLang honours it only when the server runs with ``enable_deterministic_inference``.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests}: expected >= 0")
    stops = sorted({*sampling.stop_token_ids, *stop_token_ids})
    base: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "max_new_tokens": int(sampling.max_new_tokens),
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    if stops:
        base["stop_token_ids"] = stops
    out = []
    for i in range(num_requests):
        params = dict(base)
        if sampling.seed is not None:
            params["sampling_seed"] = int(sampling.seed) + i
        out.append(params)
    return out
