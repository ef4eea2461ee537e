"""Gated NoPE MLA as a megatron module, with its own core attention (the reference layer's math, ``k3.model.mla``).

megatron-core's MLA applies RoPE and its local-spec core attention cannot take MLA's head dims (``k_channels``),
so K3 keeps its own: the latent projections ``q_a``/``kv_a`` are duplicated on every TP rank, ``q_b``/``kv_b``/
``g_proj`` are column-parallel by head, ``o_proj`` is row-parallel; the shared 64-wide key slice ``k_r`` is
broadcast to the rank's heads. Attention is causal over the full sequence (right padding needs no mask).

Packed sequences (``packed_seq_params``): attention is causal within each sequence (``packed_causal_attention``:
torch's FlashAttention varlen kernel on CUDA in BF16, one causal SDPA per sequence elsewhere).

Under context parallelism the rank's queries are its two load-balanced chunks (``k3.megatron.context_parallel``)
and attend over the K/V of the whole sequence, all-gathered over CP, with the causal mask of the tokens'
global positions (``cp_causal_attention``); the projections and the output gate are per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from k3.megatron.config import K3TransformerConfig
from k3.megatron.context_parallel import cp_causal_attention
from k3.megatron.linears import ColumnParallel, DuplicatedLinear, RowParallel, enter_tp_region, mark_grad_sum
from k3.megatron.packed import packed_causal_attention, sequence_bounds
from k3.megatron.recompute import checkpointed
from k3.megatron.sequence_major import swap_batch_and_sequence
from k3.megatron.sharded_state import tp_sharded_state_dict
from k3.model.norm import RMSNorm

__all__ = ["K3MLAttention", "causal_attention"]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q kᵀ · scale + causal) v`` on ``[batch, heads, seq, dim]`` (q/k dim may differ from v's)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class K3MLAttention(MegatronModule):
    """One MLA layer; ``hidden [s/tp, b, hidden]`` (SP) or ``[s, b, hidden]`` in and out."""

    def __init__(self, config: K3TransformerConfig, layer_number: int = 1, pg_collection=None) -> None:
        super().__init__(config=config)
        cfg = config.k3
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp
        tp = self.tp_group.size()
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh // tp  # local heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        dtype = config.params_dtype
        self.q_a_proj = DuplicatedLinear(H, cfg.q_lora_rank, config)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_latent_norm_eps, dtype=dtype)
        self.q_b_proj = ColumnParallel(cfg.q_lora_rank, nh * cfg.qk_head_dim, config, self.tp_group)
        self.kv_a_proj_with_mqa = DuplicatedLinear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, config)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_latent_norm_eps, dtype=dtype)
        self.kv_b_proj = ColumnParallel(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), config,
                                        self.tp_group)
        self.g_proj = ColumnParallel(H, nh * cfg.v_head_dim, config, self.tp_group)
        self.o_proj = RowParallel(nh * cfg.v_head_dim, H, config, self.tp_group)
        mark_grad_sum(self.q_a_layernorm.weight, "tp")
        mark_grad_sum(self.kv_a_layernorm.weight, "tp")

    def forward(self, hidden: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        """``hidden [s/tp, b, hidden]`` (normed) -> attention output, same layout (``s``: this CP rank's tokens).
        ``packed_seq_params``: megatron's THD bounds of the packed sequences (batch 1), or None."""
        x = swap_batch_and_sequence(enter_tp_region(hidden, self.config, self.tp_group))  # [b, s, hidden]
        b, s, _ = x.shape
        cu = sequence_bounds(packed_seq_params)
        if cu is not None and b != 1:
            raise ValueError(f"MLA: packed sequences come as one row, got batch {b}")
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, nh, -1)
        c_kv, k_shared = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(b, s, nh, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_shared.unsqueeze(2).expand(b, s, nh, self.rope_dim)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cp = self.cp_group is not None and self.cp_group.size() > 1

        def core(q, k, v):
            if cp:
                return cp_causal_attention(q, k, v, self.scale, self.cp_group, cu_seqlens=cu)
            if cu is not None:
                return packed_causal_attention(q, k, v, self.scale, cu)
            return causal_attention(q, k, v, self.scale)

        o = checkpointed(self.config, "core_attn", self.training, core, q, k, v)
        o = o.transpose(1, 2).reshape(b, s, nh * self.v_dim) * torch.sigmoid(self.g_proj(x))
        return self.o_proj(swap_batch_and_sequence(o))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {"q_b_proj.weight": 0, "kv_b_proj.weight": 0, "g_proj.weight": 0, "o_proj.weight": 1}
        return tp_sharded_state_dict(self, prefix, axes, sharded_offsets, metadata, self.tp_group)
