"""Block Attention Residuals (architecture §2.1): K3 replaces the residual stream with a softmax mix over depth.

Two pieces of state run through the layers: the ``partial`` sum of the current block and the ``bank`` of stored
block representations. Layer ``l``:

    1. a = Mix(bank ∪ {partial})  (a = partial while the bank is empty, i.e. at layer 0)
    2. if l opens a block (l % attn_res_block_size == 0): bank.push(partial)   after the mix, the raw partial
    3. o = Attn(input_layernorm(a));  partial = o at a block start, else partial + o
    4. m = Mix(bank ∪ {partial});     partial = partial + FFN(post_attention_layernorm(m))

and after the last layer ``h = Mix(bank ∪ {partial})`` with the model-level pseudo-query. ``Mix`` scores each
candidate ``v_i`` per token as ``RMSNorm(v_i) · (res_norm.weight ⊙ res_proj.weight)`` in float32 and returns
``Σ softmax(s)_i v_i``: ``res_proj`` is a scoring vector, not a projection of the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from k3.kernels.attn_res_mix import attn_res_mix as mix_over_depth
from k3.model.norm import RMSNorm

__all__ = ["attn_res_mix", "AttnResBank", "attn_res_layer", "attn_res_final"]


def attn_res_mix(candidates: Sequence[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Softmax mix over depth (``k3.kernels.attn_res_mix``: its ``naive.py`` is the math; one Triton kernel in the
    embedded engine's window-mode decode on CUDA).

    Args:
        candidates: n tensors ``[..., hidden]`` (stored blocks, then the live partial sum).
        norm: the ``*_res_norm`` (its weight and eps); proj: the ``*_res_proj`` ``Linear(hidden, 1)``.

    Returns:
        ``[..., hidden]`` in the candidates' dtype.
    """
    return mix_over_depth(candidates, norm.weight, proj.weight, norm.eps)


class AttnResBank:
    """The stored block representations of one forward pass (each ``[batch, seq, hidden]``)."""

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []

    def push(self, partial: torch.Tensor) -> None:
        self.blocks.append(partial)

    def mix(self, partial: torch.Tensor, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
        """``Mix(bank ∪ {partial})``."""
        return attn_res_mix([*self.blocks, partial], norm, proj)


def attn_res_layer(
    bank: AttnResBank,
    partial: torch.Tensor,
    *,
    block_start: bool,
    attn_res: tuple[RMSNorm, nn.Linear],
    attn: Callable[[torch.Tensor], torch.Tensor],
    mlp_res: tuple[RMSNorm, nn.Linear],
    ffn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One decoder layer's residual protocol (steps 1–4 above); returns the new partial sum.

    ``attn`` and ``ffn`` take the mixed stream and apply their own pre-norm.
    """
    a = bank.mix(partial, *attn_res) if bank.blocks else partial
    if block_start:
        bank.push(partial)
    o = attn(a)
    partial = o if block_start else partial + o
    m = bank.mix(partial, *mlp_res)
    return partial + ffn(m)


def attn_res_final(bank: AttnResBank, partial: torch.Tensor, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """The mix after the last layer, over every stored block and the live partial sum."""
    return bank.mix(partial, norm, proj)
