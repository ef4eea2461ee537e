"""Token sampling from next-token logits: greedy, temperature, nucleus (top-p), on the logits' device.

``sample_next`` is the torch reference; ``sample_next_flashinfer`` draws the same distribution with flashinfer's
top-p kernel (``k3.kernels.mla_decode.flashinfer``; a different random stream, so seeded draws differ from torch's).
Both keep everything on the device: no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3.kernels.mla_decode.flashinfer import top_p_sample

__all__ = ["Sampler", "sample_next", "sample_next_flashinfer"]

# (logits [batch, vocab], temperature, top_p, generator) -> (tokens [batch] int64, logprobs [batch] fp32)
Sampler = Callable[[torch.Tensor, float, float, torch.Generator | None], tuple[torch.Tensor, torch.Tensor]]


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    ``logits`` [batch, vocab] (any float dtype). Returns ``(tokens [batch] int64, logprobs [batch] fp32)`` where
    the log-probability is of the chosen token under the *unscaled* model distribution (temperature 1, no top-p),
    which is what the trainer recomputes. ``generator`` (seeded draws) must be on the logits' device.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        tok = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            probs = _top_p_filter(probs, top_p)
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def sample_next_flashinfer(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next`` with the draw on flashinfer's top-p kernel (CUDA); greedy stays argmax."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        tok = logits.argmax(dim=-1)
    else:
        tok = top_p_sample(torch.softmax(logits / temperature, dim=-1), top_p, generator)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p`` (the top token always stays)."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)
