"""The K3 decoder layer as a megatron ``TransformerLayer``-like module: Block Attention Residuals (AttnRes).

K3 has no plain residual stream (reference: ``k3.model.attn_res``). The layer carries the block's ``partial``
sum as megatron's ``hidden_states`` and the bank of stored block sums as megatron's ``context`` (the
``(hidden_states, context)`` contract of ``TransformerBlock``): ``bank [n, s/tp, b, hidden]``, pushed at block
starts. The mixes are the reference's ``attn_res_mix`` on the sequence-parallel token shard. The last layer of
the model applies the final mix (``output_attn_res_*``); the final norm is the block's ``final_layernorm``.

Under pipeline parallelism only one tensor crosses a stage boundary: the last layer of a stage sends
``[partial | bank rows]`` concatenated on the hidden dim and the first layer of the next stage splits it; the
number of rows is fixed by the layer index (``ceil(first_layer / block_size)`` blocks were pushed before it), so
a wrong width fails loudly instead of being reinterpreted.

Under context parallelism nothing here changes: the mixes are per token (each bank row and the partial sum are
``[s, b, hidden]`` over the same local tokens), so they run on the rank's load-balanced tokens as they are. The same
holds for packed sequences (megatron's THD ``packed_seq_params``): the layer hands the bounds to its attention and
nothing else of it looks across tokens (``k3.megatron.packed``). Activation recompute is megatron's
(``k3.megatron.recompute``): whole layers under ``full``, the listed parts under ``selective``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from torch import nn

from k3.megatron.config import K3TransformerConfig
from k3.megatron.linears import mark_sequence_parallel
from k3.megatron.moe import K3LatentMoE
from k3.megatron.recompute import checkpointed
from k3.model.attn_res import attn_res_mix
from k3.model.norm import RMSNorm

__all__ = ["K3RMSNorm", "K3LayerSubmodules", "K3TransformerLayer", "pushes_before", "pack_stage_output",
           "unpack_stage_input"]


class K3RMSNorm(RMSNorm):
    """The reference RMSNorm built megatron's way (``config, hidden_size, eps``), per token on the SP shard."""

    def __init__(self, config: K3TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps, dtype=config.params_dtype)
        mark_sequence_parallel(self, config)


def _res_pair(config: K3TransformerConfig) -> tuple[K3RMSNorm, nn.Linear]:
    H = config.hidden_size
    norm = K3RMSNorm(config, H, config.k3.rms_norm_eps)
    proj = nn.Linear(H, 1, bias=False, dtype=config.params_dtype)
    nn.init.zeros_(proj.weight)  # the pseudo-queries start at zero: every mix starts uniform
    mark_sequence_parallel(proj, config)
    return norm, proj


def pushes_before(layer: int, block_size: int) -> int:
    """How many bank rows exist when 0-based ``layer`` starts (blocks open at 0, B, 2B, …)."""
    return math.ceil(layer / block_size)


def pack_stage_output(partial: torch.Tensor, bank: torch.Tensor | None) -> torch.Tensor:
    """The one tensor a stage sends: ``[partial | bank row 0 | … ]`` on the hidden dim, ``[s, b, (1 + n)·H]``."""
    return partial if bank is None else torch.cat([partial, *bank.unbind(0)], dim=-1)


def unpack_stage_input(packed: torch.Tensor, hidden: int, rows: int,
                       layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`pack_stage_output`: ``(partial [s, b, H], bank [rows, s, b, H] or None)``; a width
    other than ``(1 + rows)·hidden`` raises (``layer`` names the receiving layer in the message)."""
    if packed.shape[-1] != (1 + rows) * hidden:
        where = "stage input" if layer is None else f"layer {layer}: stage input"
        raise ValueError(f"{where} has width {packed.shape[-1]}, expected (1 + {rows} bank rows) x {hidden} = "
                         f"{(1 + rows) * hidden}")
    parts = packed.split(hidden, dim=-1)
    return parts[0], (torch.stack(parts[1:]) if rows else None)


@dataclass
class K3LayerSubmodules:
    """The attention (``K3KDAttention`` / ``K3MLAttention``) and FFN (``K3DenseMLP`` / ``K3LatentMoE``) of a layer."""

    self_attention: ModuleSpec | type
    mlp: ModuleSpec | type


class K3TransformerLayer(MegatronModule, BaseTransformerLayer):
    """One K3 layer. ``layer_number`` is megatron's 1-based index within the stage; ``self.layer_number`` is
    the global 1-based number (``self.layer_idx`` the 0-based one)."""

    def __init__(self, config: K3TransformerConfig, submodules: K3LayerSubmodules, layer_number: int = 1,
                 pg_collection=None, vp_stage: int | None = None, unpack_input: bool = False,
                 pack_output: bool = False) -> None:
        super().__init__(config=config)
        cfg = config.k3
        self.pg_collection = pg_collection
        pp_rank = pg_collection.pp.rank() if pg_collection is not None and hasattr(pg_collection, "pp") else None
        self.layer_idx = layer_number - 1 + get_transformer_layer_offset(config, vp_stage, pp_rank)
        self.layer_number = self.layer_idx + 1
        self.block_size = cfg.attn_res_block_size
        self.block_start = cfg.is_block_start(self.layer_idx)
        self.is_last = self.layer_idx == cfg.num_hidden_layers - 1
        self.unpack_input, self.pack_output = unpack_input, pack_output
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = K3RMSNorm(config, H, eps)
        self.pre_mlp_layernorm = K3RMSNorm(config, H, eps)
        self.self_attention_res_norm, self.self_attention_res_proj = _res_pair(config)
        self.mlp_res_norm, self.mlp_res_proj = _res_pair(config)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=self.layer_number,
                                           pg_collection=pg_collection)
        self.mlp = build_module(submodules.mlp, config=config, layer_number=self.layer_number,
                                pg_collection=pg_collection)
        if self.is_last:
            self.output_attn_res_norm, self.output_attn_res_proj = _res_pair(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                context: torch.Tensor | None = None, packed_seq_params=None, inference_context=None,
                **_unused) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states``: the partial sum ``[s/tp, b, hidden]`` (or the packed stage input); ``context``: the
        bank ``[n, s/tp, b, hidden]`` or None. Returns the next ``(partial, bank)``."""
        if attention_mask is not None:
            raise ValueError("K3 megatron layers take no attention_mask: attention is causal, padding goes on the "
                             "right, and packed sequences carry their boundaries in packed_seq_params (cu_seqlens)")
        if inference_context is not None:
            raise ValueError("K3 megatron layers take no inference_context: the megatron backend trains and scores "
                             "whole sequences; generation runs in the rollout engine")
        partial, bank = self._unpack(hidden_states) if self.unpack_input else (hidden_states, context)
        config, training = self.config, self.training

        def mix(candidate: torch.Tensor, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
            rows = [] if bank is None else list(bank.unbind(0))
            return attn_res_mix([*rows, candidate], norm, proj)

        a = partial if bank is None else mix(partial, self.self_attention_res_norm, self.self_attention_res_proj)
        if self.block_start:
            bank = partial.unsqueeze(0) if bank is None else torch.cat([bank, partial.unsqueeze(0)])
        o = self.self_attention(checkpointed(config, "layernorm", training, self.input_layernorm, a),
                                packed_seq_params=packed_seq_params)
        partial = o if self.block_start else partial + o
        m = mix(partial, self.mlp_res_norm, self.mlp_res_proj)
        ffn = "moe" if isinstance(self.mlp, K3LatentMoE) else "mlp"
        normed = checkpointed(config, "layernorm", training, self.pre_mlp_layernorm, m)
        partial = partial + checkpointed(config, ffn, training, self.mlp, normed)
        if self.is_last:
            return mix(partial, self.output_attn_res_norm, self.output_attn_res_proj), None
        if self.pack_output:
            return pack_stage_output(partial, bank), None
        return partial, bank

    def _unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = pushes_before(self.layer_idx, self.block_size)
        return unpack_stage_input(packed, self.config.hidden_size, rows, self.layer_idx)
