"""Per-token log-probs (and entropies) from a model's logits, the log-softmax over the vocabulary taken in chunks of
tokens: the torch backend's form of the recipe's ``--log-probs-chunk-size``.

Over the whole ``[tokens, vocab]`` at once, ``log_softmax(logits.float())`` makes a float32 copy of every token's
logits and a float32 result of the same size (and the entropy two more). In chunks of ``chunk_size`` tokens those
temporaries exist for one chunk at a time. With gradients, each chunk runs under activation checkpointing: autograd
then keeps the logits (which it needs anyway) instead of every chunk's float32 log-softmax, and the backward
recomputes one chunk at a time. Each token's log-softmax reads its own row only, so the values and gradients are
the plain ones (``k3.rl.grpo.token_log_probs`` / ``token_entropy``, applied per chunk).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from k3.rl.grpo import token_entropy, token_log_probs
from k3.settings.train import NO_LOG_PROBS_CHUNKING, check_log_probs_chunk_size

__all__ = ["chunked_token_log_probs"]


def chunked_token_log_probs(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p(target) [...], entropy [...] or None)``, float32 nats, from ``logits [..., vocab]`` and ``targets
    [...]`` (ids), the log-softmax taken over ``chunk_size`` tokens at a time (tokens in the order of the flattened
    leading dims; :data:`NO_LOG_PROBS_CHUNKING`: all at once). The entropy carries no gradient. Contiguous ``logits``
    are chunked without a copy."""
    check_log_probs_chunk_size(chunk_size)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not line up")
    if chunk_size == NO_LOG_PROBS_CHUNKING:
        log_probs = token_log_probs(logits, targets)
        if not with_entropy:
            return log_probs, None
        with torch.no_grad():
            return log_probs, token_entropy(logits)
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    grad = torch.is_grad_enabled() and flat.requires_grad
    log_probs, entropy = [], []
    for piece, piece_targets in zip(flat.split(chunk_size), flat_targets.split(chunk_size)):
        if grad:  # deterministic: no random state to replay in the recompute
            log_probs.append(checkpoint(token_log_probs, piece, piece_targets, use_reentrant=False,
                                        preserve_rng_state=False))
        else:
            log_probs.append(token_log_probs(piece, piece_targets))
        if with_entropy:
            with torch.no_grad():
                entropy.append(token_entropy(piece))
    return (torch.cat(log_probs).reshape(targets.shape),
            torch.cat(entropy).reshape(targets.shape) if with_entropy else None)
