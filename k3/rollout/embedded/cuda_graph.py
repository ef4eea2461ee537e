"""One decode step captured as a CUDA graph for a batch-size bucket (``torch.cuda.CUDAGraph``).

The step is ``KimiK3ForCausalLM.decode_step`` in window mode over one ``StaticK3Cache`` rows view: it reads the
device-side position and writes the cache in place, so replaying the graph advances the decode exactly as the eager
call would. Inputs go through a static token buffer, the logits come out in a static buffer (overwritten by the next
replay). Capturing runs a few warm-up steps on a side stream first (Triton autotuning, cuBLAS workspaces, lazy
initialisation must not happen under capture); they write into the cache, which is reset afterwards.
"""

from __future__ import annotations

import torch

from k3.model import KimiK3ForCausalLM
from k3.model.cache import StaticK3Cache
from k3.model.mla import MLADecodeAttention

__all__ = ["DecodeGraph", "WARMUP_STEPS"]

WARMUP_STEPS = 3


class DecodeGraph:
    """A captured ``decode_step(tokens, cache, attention)`` for ``cache.batch_size`` rows.

    Args:
        model: the engine's model (its parameters must stay where they are while the graph lives).
        cache: the rows view the graph reads and writes (reset on return).
        attention: the window's MLA attention (a flashinfer one must already be planned: the plan's buffers are
            what the captured kernels read, replanned before every replay).
        pool: a graph memory pool shared by the buckets (``torch.cuda.graph_pool_handle()``).
    """

    def __init__(self, model: KimiK3ForCausalLM, cache: StaticK3Cache, attention: MLADecodeAttention,
                 pool: tuple[int, int]) -> None:
        device = cache.key_mask.device
        if device.type != "cuda":
            raise ValueError(f"DecodeGraph: the cache is on {device}: CUDA graphs need a CUDA device")
        self.cache = cache
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.int64, device=device)
        cache.reset()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                model.decode_step(self.tokens, cache, attention)
        torch.cuda.current_stream(device).wait_stream(side)
        cache.reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model.decode_step(self.tokens, cache, attention)
        cache.reset()

    def replay(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the step for ``tokens [batch]``; returns the static logits ``[batch, vocab]`` (valid until the next
        replay). The host count of the cache is the caller's to advance."""
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
