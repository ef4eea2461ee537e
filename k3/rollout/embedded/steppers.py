"""How the model runs one batch of the embedded engine's decode loop (``decode_loop.Stepper``), one class per mode.

- ``EagerStepper``: the plain reference — a grown ``K3Cache`` and the attention mask concatenated per step, every
  step a checked ``forward`` (host syncs inside: input range and mask checks).
- ``StaticStepper``: a ``StaticK3Cache`` at host positions; the same operations as eager, nothing grown or checked
  per step (on CPU the same logits to the bit).
- ``WindowStepper``: the static cache at its device-side position, MLA in the absorbed form (torch or flashinfer),
  optionally replaying a captured CUDA graph; batches are padded to the view's rows with one-token dummy rows.

The reference modes take the prefill's logits from the full ``forward`` output, as the engine always did (on CPU a
GEMM over fewer rows can round differently); the window modes project the last position only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.model import KimiK3ForCausalLM
from k3.model.cache import K3Cache, StaticK3Cache
from k3.model.mla import MLADecodeAttention
from k3.rollout.embedded.cuda_graph import DecodeGraph
from k3.rollout.embedded.flashinfer_attention import FlashInferWindowAttention

__all__ = ["EagerStepper", "StaticStepper", "WindowStepper"]


class EagerStepper:
    """The reference: ``forward`` with a grown ``K3Cache``, the mask concatenated per step."""

    def __init__(self, model: KimiK3ForCausalLM) -> None:
        self.model = model
        self.cache: K3Cache | None = None
        self.mask: torch.Tensor | None = None

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.cache = self.model.init_cache(ids.shape[0])
        self.mask = mask
        return self.model(ids, cache=self.cache, attention_mask=mask)[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        return self.model(tokens[:, None], cache=self.cache, attention_mask=self.mask)[:, -1]


class StaticStepper:
    """The reference's operations on a preallocated ``StaticK3Cache`` (an emptied rows view of the batch's size)."""

    def __init__(self, model: KimiK3ForCausalLM, cache: StaticK3Cache) -> None:
        self.model, self.cache = model, cache

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, cache=self.cache, attention_mask=mask)[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.decode_step(tokens, self.cache)


class WindowStepper:
    """Decode from the static cache's device-side position, eagerly or by replaying a captured graph.

    Args:
        model: the engine's model. cache: an emptied rows view with at least the batch's rows (extra rows run a
            one-token dummy prompt of ``pad_id`` and are never sampled).
        prompt_lens: real prompt tokens per row of the batch (the host knows them: flashinfer's pages start there).
        attention: the window's MLA attention (``mla_decode_masked`` or a ``FlashInferWindowAttention``).
        graph: the captured step for ``cache`` (None: call ``decode_step`` eagerly).
    """

    def __init__(self, model: KimiK3ForCausalLM, cache: StaticK3Cache, prompt_lens: Sequence[int], pad_id: int,
                 attention: MLADecodeAttention, graph: DecodeGraph | None = None) -> None:
        if len(prompt_lens) > cache.batch_size:
            raise ValueError(f"WindowStepper: {len(prompt_lens)} rows for a {cache.batch_size}-row cache view")
        self.model, self.cache, self.attention, self.graph = model, cache, attention, graph
        self.lens, self.pad_id = list(prompt_lens), pad_id
        self.planner = attention if isinstance(attention, FlashInferWindowAttention) else None
        self.tokens = torch.full((cache.batch_size,), pad_id, dtype=torch.int64, device=cache.key_mask.device)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L = ids.shape
        extra = self.cache.batch_size - B
        if extra:  # dummy rows: one real pad token in the last column
            dummy_mask = mask.new_zeros(extra, L)
            dummy_mask[:, -1] = 1
            ids = torch.cat([ids, ids.new_full((extra, L), self.pad_id)])
            mask = torch.cat([mask, dummy_mask])
        hidden = self.model.model(ids, cache=self.cache, attention_mask=mask)
        if self.planner is not None:
            self.planner.begin_batch([L - n for n in self.lens] + [L - 1] * extra)
        return self.model.lm_head(hidden[:B, -1])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        B = tokens.shape[0]
        self.tokens[:B] = tokens
        if self.planner is not None:
            self.planner.plan_step(self.cache.seen_tokens + 1)
        if self.graph is not None:
            logits = self.graph.replay(self.tokens)
        else:
            logits = self.model.decode_step(self.tokens, self.cache, self.attention)
        self.cache.note_device_step()
        return logits[:B]
