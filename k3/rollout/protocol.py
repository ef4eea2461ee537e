"""The rollout-engine protocol shared by the embedded engine and the SGLang engine (DESIGN.md, Contracts).

An engine turns prompts into samples and accepts LoRA adapter versions from the trainer:

    generate(requests, sampling) -> list[Sample]      # tokens, text, per-token logprobs
    load_adapter(chunks, version)                     # a complete version, or nothing changes
    adapter_version() -> int
    release_memory(tags) / resume_memory(tags)        # tags: "weights", "kv_cache", "cuda_graph"
    shutdown()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy; ``top_p`` in (0, 1]; lengths in tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: expected >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: expected 0 < top_p <= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: expected >= 1")


@dataclass
class GenerateRequest:
    """One prompt, already tokenised (``prompt_ids``), with an opaque ``meta`` carried to the sample."""

    prompt_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One generated response.

    ``tokens`` are the response tokens only (the eos included when it was produced), ``logprobs[i]`` is the
    engine's log-probability of ``tokens[i]`` under the unscaled model distribution (nats), ``finish_reason``
    is ``"stop"`` (eos / stop token) or ``"length"``.
    """

    prompt_ids: list[int]
    tokens: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    adapter_version: int
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]: ...

    def load_adapter(self, chunks: Iterable[Any], version: int) -> None: ...

    def adapter_version(self) -> int: ...

    def release_memory(self, tags: Sequence[str]) -> None: ...

    def resume_memory(self, tags: Sequence[str]) -> None: ...

    def shutdown(self) -> None: ...


def check_tags(tags: Sequence[str]) -> list[str]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}: expected a subset of {list(MEMORY_TAGS)}")
    return list(tags)
