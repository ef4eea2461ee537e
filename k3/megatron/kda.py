"""KDA as a megatron module: the reference layer's math (``k3.model.kda``) on TP-sharded heads.

Each TP rank owns ``heads / tp`` KDA heads: the q/k/v/g/f_b/b projections, short convs, ``A_log`` and
``dt_bias`` are split by head; ``f_a`` and the per-head output norm ``o_norm`` are replicated; ``o_proj`` is
row-parallel. The heads are independent, so the recurrence runs locally on the full sequence (gathered from
the sequence-parallel shards when entering the TP region).

Packed sequences (``packed_seq_params``, ``k3.megatron.packed``): the short convs restart from a zero history and
the core from a zero state at every sequence boundary (fla's varlen ``cu_seqlens`` on CUDA, the torch forms per
sequence elsewhere).

Under context parallelism the rank holds two chunks of each sequence (the load-balanced layout of
``k3.megatron.context_parallel``): the short convs take their ``kernel − 1`` halo inputs from the neighbour
ranks and the core runs the whole sequence's recurrence (``cp_kda_core``: the state chain on the torch path,
fla's CP kernels on CUDA). Every other step is per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from torch import nn

from k3.kernels.kda.fla import kda_core
from k3.megatron.config import K3TransformerConfig
from k3.megatron.context_parallel import cp_causal_conv, cp_kda_core
from k3.megatron.linears import ColumnParallel, DuplicatedLinear, RowParallel, enter_tp_region, mark_grad_sum
from k3.megatron.packed import packed_causal_conv, sequence_bounds
from k3.megatron.recompute import checkpointed
from k3.megatron.sequence_major import swap_batch_and_sequence
from k3.megatron.sharded_state import tp_sharded_state_dict
from k3.model.kda import CausalConv1d, kda_gate, l2_normalize
from k3.model.norm import GatedRMSNorm
from k3.model.precision import KeepsFloat32

__all__ = ["K3KDAttention"]

_HEAD_SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "f_b_proj.weight",
               "b_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log", "dt_bias")


class K3KDAttention(KeepsFloat32, MegatronModule):
    """One KDA layer; ``hidden [s/tp, b, hidden]`` (SP) or ``[s, b, hidden]`` in and out.

    Parameter names are the checkpoint's (``self_attention.q_proj.weight`` …); ``A_log`` is ``[heads]`` (the
    HF padding is handled by ``k3.checkpoint.names``). ``A_log``, ``dt_bias``, the conv weights and
    ``o_norm`` stay float32 whatever the model dtype.
    """

    float32_params = ("A_log", "dt_bias")

    def __init__(self, config: K3TransformerConfig, layer_number: int = 1, pg_collection=None) -> None:
        super().__init__(config=config)
        cfg, la = config.k3, config.k3.linear_attn_config
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp
        tp = self.tp_group.size()
        H, P, D = cfg.hidden_size, cfg.kda_proj_size, la.head_dim
        self.num_heads = la.num_heads // tp  # local heads
        self.head_dim = D
        self.lower_bound = la.gate_lower_bound
        self.q_proj = ColumnParallel(H, P, config, self.tp_group)
        self.k_proj = ColumnParallel(H, P, config, self.tp_group)
        self.v_proj = ColumnParallel(H, P, config, self.tp_group)
        self.q_conv1d = CausalConv1d(P // tp, la.short_conv_kernel_size)
        self.k_conv1d = CausalConv1d(P // tp, la.short_conv_kernel_size)
        self.v_conv1d = CausalConv1d(P // tp, la.short_conv_kernel_size)
        self.f_a_proj = DuplicatedLinear(H, D, config)
        self.f_b_proj = ColumnParallel(D, P, config, self.tp_group)
        self.b_proj = ColumnParallel(H, la.num_heads, config, self.tp_group)
        self.g_proj = ColumnParallel(H, P, config, self.tp_group)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P // tp, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = RowParallel(P, H, config, self.tp_group)
        for p in (self.A_log, self.dt_bias, self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        mark_grad_sum(self.o_norm.weight, "tp")
        if config.perform_initialization:
            self._init_small_params()

    @torch.no_grad()
    def _init_small_params(self) -> None:
        # The reference model's init (fla's KDA init); real runs load a checkpoint over it.
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            bound = conv.kernel_size**-0.5
            nn.init.uniform_(conv.weight, -bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, hidden: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        """``hidden [s/tp, b, hidden]`` (normed) -> attention output, same layout (``s``: this CP rank's tokens).
        ``packed_seq_params``: megatron's THD bounds of the packed sequences (batch 1), or None."""
        x = swap_batch_and_sequence(enter_tp_region(hidden, self.config, self.tp_group))  # [b, s, hidden]
        b, s, _ = x.shape
        cu = sequence_bounds(packed_seq_params)
        if cu is not None and b != 1:
            raise ValueError(f"KDA: packed sequences come as one row, got batch {b}")
        heads = (b, s, self.num_heads, self.head_dim)
        cp = self.cp_group is not None and self.cp_group.size() > 1
        inputs = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        convs: list[CausalConv1d] = [self.q_conv1d, self.k_conv1d, self.v_conv1d]
        if cp:
            ys = cp_causal_conv(inputs, convs, self.cp_group, cu)
        elif cu is not None:
            ys = [packed_causal_conv(u, conv, cu) for u, conv in zip(inputs, convs)]
        else:
            ys = [conv(u, None)[0] for u, conv in zip(inputs, convs)]
        q, k, v = (F.silu(y).to(x.dtype).view(heads) for y in ys)
        q, k = l2_normalize(q), l2_normalize(k)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        scale = self.head_dim**-0.5

        def core(q, k, v, g, beta):
            if cp:
                return cp_kda_core(q, k, v, g, beta, scale, self.cp_group, cu_seqlens=cu)
            return kda_core(q, k, v, g, beta, scale=scale, cu_seqlens=cu)[0]

        o = checkpointed(self.config, "core_attn", self.training, core, q, k, v, g, beta)
        o = self.o_norm(o, self.g_proj(x).view(heads), out_dtype=x.dtype)
        return self.o_proj(swap_batch_and_sequence(o.reshape(b, s, -1)))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {name: 0 for name in _HEAD_SPLIT}
        axes["o_proj.weight"] = 1
        return tp_sharded_state_dict(self, prefix, axes, sharded_offsets, metadata, self.tp_group)
