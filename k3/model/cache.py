"""K3Cache: what incremental decoding carries between calls.

Per KDA layer the recurrent state ``[batch, heads, K, V]`` (float32) and the last ``conv_kernel − 1`` inputs of
the q/k/v short convolutions ``[batch, proj, conv_kernel − 1]`` (float32, the conv weights' dtype); per MLA
layer the ``kv_lora_rank + qk_rope_head_dim`` latent of every token seen (576 for K3, model dtype); and, for
the whole model, how many tokens were seen and the attention mask so far. AttnRes needs nothing here: it
mixes over depth, one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config

__all__ = ["K3Cache", "KDALayerState", "MLALayerState"]


@dataclass
class KDALayerState:
    """One KDA layer's carry: ``recurrent [b, H, K, V]`` and ``conv_{q,k,v} [b, proj, kernel − 1]``."""

    recurrent: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor


@dataclass
class MLALayerState:
    """One MLA layer's cache: ``latent [b, seen, kv_lora_rank + qk_rope_head_dim]`` (before the latent norm)."""

    latent: torch.Tensor


class K3Cache:
    """Decoding state of one batch. Create with ``KimiK3ForCausalLM.init_cache(batch_size)``."""

    def __init__(self, cfg: K3Config, batch_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"K3Cache: batch_size={batch_size!r}: expected a positive integer")
        self.batch_size = batch_size
        self.seen_tokens = 0
        # [batch, seen] bool, 1 = real token; None while every token seen so far is real.
        self.attention_mask: torch.Tensor | None = None
        la = cfg.linear_attn_config
        proj, history = cfg.kda_proj_size, la.short_conv_kernel_size - 1
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.layers: list[KDALayerState | MLALayerState] = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda_layer(i):
                conv = lambda: torch.zeros(batch_size, proj, history, dtype=torch.float32, device=device)  # noqa: E731
                self.layers.append(KDALayerState(
                    recurrent=torch.zeros(batch_size, la.num_heads, la.head_dim, la.head_dim,
                                          dtype=torch.float32, device=device),
                    conv_q=conv(), conv_k=conv(), conv_v=conv(),
                ))
            else:
                self.layers.append(MLALayerState(torch.zeros(batch_size, 0, latent, dtype=dtype, device=device)))

    def nbytes(self) -> int:
        """Bytes held by all layer states."""
        total = 0
        for s in self.layers:
            tensors = (s.recurrent, s.conv_q, s.conv_k, s.conv_v) if isinstance(s, KDALayerState) else (s.latent,)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def __repr__(self) -> str:
        return f"K3Cache(batch_size={self.batch_size}, seen_tokens={self.seen_tokens}, layers={len(self.layers)})"
