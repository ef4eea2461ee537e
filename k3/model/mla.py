"""Gated NoPE MLA (architecture §2.3): the 24 softmax-attention layers of K3.

    q        = q_b(RMSNorm(q_a x))                          [heads, nope + rope]
    c        = kv_a_proj_with_mqa x = [c_kv | k_r]          the cached latent (kv_lora + rope = 576)
    k_nope,v = kv_b(RMSNorm(c_kv))                          per head
    k        = [k_nope | k_r]                               k_r shared by all heads, not normed, not rotated
    o        = softmax(q kᵀ / √(nope + rope) + causal) v
    y        = o_proj(o · sigmoid(g_proj x))

No RoPE anywhere (``mla_use_nope``); the "rope" dims are plain shared key dims. The latent norms use
``cfg.mla_latent_norm_eps`` (1e-6, as the HF reference builds them).

Decoding from a ``StaticK3Cache`` at its device-side position (``MLAttention.decode_window``) uses the absorbed form
of the same math: with ``c = RMSNorm(c_kv)`` cached and ``kv_b = [W_UK; W_UV]`` per head,
``q·k = (q_nope W_UK)·c + q_rope·k_r`` and ``o = (Σ p c) W_UVᵀ``, so attention runs in the 512-wide latent space
over the cached ``c`` and ``k_r`` (``k3.kernels.mla_decode``) and nothing is expanded per cached token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.kernels.mla_decode.naive import mla_decode_masked
from k3.model.cache import MLALayerState, StaticMLALayerState
from k3.model.norm import RMSNorm

__all__ = ["MLAttention", "MLADecodeAttention", "MLAWindow", "attention_allowed"]

# (q_latent [b, h, C], q_rope [b, h, R], ckv [b, T, C], kpe [b, T, R], valid [b, T] bool, scale) -> [b, h, C]:
# attention in the latent space over a static cache window (k3.kernels.mla_decode.naive.mla_decode_masked is the
# torch form; a paged kernel may ignore ``valid`` and read the lengths it was planned with).
MLADecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                              torch.Tensor]


@dataclass(frozen=True)
class MLAWindow:
    """One decode step over a static cache addressed on the device: ``position [1]`` int64 (the column written
    this step), ``valid [b, max_len]`` bool (the key mask, this step's column included) and the latent attention."""

    position: torch.Tensor
    valid: torch.Tensor
    attention: MLADecodeAttention = mla_decode_masked


def attention_allowed(query_len: int, past: int, key_mask: torch.Tensor | None,
                      device: torch.device) -> torch.Tensor:
    """Which keys each query may see: ``[batch or 1, 1, query_len, past + query_len]`` bool.

    Causal over absolute positions (query i sits at ``past + i``); padded keys are hidden from real queries.
    A padded query sees every causal key instead, so its row is never empty (no NaN) — its output is
    discarded anyway.
    """
    total = past + query_len
    q_pos = torch.arange(past, total, device=device).unsqueeze(-1)
    allowed = torch.arange(total, device=device).unsqueeze(0) <= q_pos  # [q, total]
    if key_mask is None:
        return allowed[None, None]
    query_real = key_mask[:, past:].unsqueeze(-1)  # [b, q, 1]
    allowed = allowed & (key_mask.unsqueeze(1) | ~query_real)  # [b, q, total]
    return allowed.unsqueeze(1)


class MLAttention(nn.Module):
    """One MLA layer. Names and shapes are the HF checkpoint's (``self_attn.*``)."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx = layer_idx
        self.num_heads = nh
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_latent_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.g_proj = nn.Linear(H, nh * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, H, bias=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                state: MLALayerState | StaticMLALayerState | None = None) -> torch.Tensor:
        """One MLA layer.

        Args:
            x: ``[batch, seq, hidden]`` normed layer input (the new tokens).
            key_mask: ``[batch, cached + seq]`` bool, False at padding; None when every token is real.
            state: the latent cache, extended with this call's tokens (grown, or written in place at the host
                position of a static cache); None for a standalone pass.

        Returns:
            ``[batch, seq, hidden]``.
        """
        b, s, _ = x.shape
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, nh, -1)
        latent = self.kv_a_proj_with_mqa(x)  # [b, s, kv_lora + rope]
        if isinstance(state, StaticMLALayerState):
            c_new, k_new = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            # The norm is per token, so normalising the new tokens once equals normalising every cached token
            # per call; contiguous, so the projection below sees the same operand as from a grown cache.
            normed, k_shared = state.append(self.kv_a_layernorm(c_new), k_new)
            normed = normed.contiguous()
        else:
            if state is not None:
                latent = torch.cat([state.latent, latent], dim=1)
                state.latent = latent
            c_kv, k_shared = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            normed = self.kv_a_layernorm(c_kv)
        total = normed.shape[1]
        past = total - s
        kv = self.kv_b_proj(normed).view(b, total, nh, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_shared.unsqueeze(2).expand(b, total, nh, self.rope_dim)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, tokens, dim]
        if key_mask is None and past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            allowed = attention_allowed(s, past, key_mask, x.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        o = o.transpose(1, 2).reshape(b, s, nh * self.v_dim)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))

    def absorbed_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [heads, nope, kv_lora], W_UV [heads, v, kv_lora])``: views of ``kv_b_proj.weight``.

        Raises ValueError when ``kv_b_proj`` is not a plain ``nn.Linear`` (an adapter on it would be left out).
        """
        if type(self.kv_b_proj) is not nn.Linear:
            raise ValueError(f"MLA layer {self.layer_idx}: kv_b_proj is a {type(self.kv_b_proj).__name__}, not a "
                             "plain nn.Linear: the absorbed decode reads its weight and would miss what it adds")
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def decode_window(self, x: torch.Tensor, state: StaticMLALayerState, window: MLAWindow) -> torch.Tensor:
        """One token per row from a static cache at the device-side position (no host sync, capturable).

        Args:
            x: ``[batch, 1, hidden]`` normed layer input.
            state: the layer's static latent cache; this token's ``RMSNorm(c_kv)`` and ``k_r`` are written at
                ``window.position``.
            window: position, key mask and the latent attention (absorbed form, see the module docstring).

        Returns:
            ``[batch, 1, hidden]``.
        """
        b = x.shape[0]
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, nh, -1)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_new, k_new = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        state.write_at(window.position, self.kv_a_layernorm(c_new), k_new)
        w_uk, w_uv = self.absorbed_kv_b()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [b, heads, kv_lora]
        o_latent = window.attention(q_latent, q_rope, state.ckv, state.kpe, window.valid, self.scale)
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [b, heads, v]
        o = o.reshape(b, 1, nh * self.v_dim)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))
