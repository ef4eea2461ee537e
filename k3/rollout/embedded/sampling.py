"""Token sampling from next-token logits: greedy, temperature, nucleus (top-p)."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    ``logits`` [batch, vocab] (any float dtype). Returns ``(tokens [batch] int64, logprobs [batch] fp32)`` where
    the log-probability is of the chosen token under the *unscaled* model distribution (temperature 1, no top-p),
    which is what the trainer recomputes.
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


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p`` (the top token always stays)."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)
