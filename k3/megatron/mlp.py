"""SiTU-GLU MLP as a megatron module: layer 0's dense MLP and the MoE layers' shared experts.

``linear_fc2(SiTU(linear_fc1 x))`` with the fused ``linear_fc1 = [gate; up]`` column-parallel (each rank holds
``[gate_t; up_t]``, stored as two TP-split halves) and ``linear_fc2`` row-parallel; SiTU is the reference's
``k3.model.mlp.situ``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from k3.megatron.config import K3TransformerConfig
from k3.megatron.linears import ColumnParallel, RowParallel, enter_tp_region
from k3.megatron.sharded_state import tp_sharded_state_dict
from k3.model.mlp import situ

__all__ = ["K3SiTUMLP", "K3DenseMLP", "K3SharedExperts"]


class K3SiTUMLP(MegatronModule):
    """``hidden [s/tp, b, hidden]`` (SP) or ``[s, b, hidden]`` -> same layout, through width ``intermediate``."""

    def __init__(self, config: K3TransformerConfig, intermediate_size: int, pg_collection) -> None:
        super().__init__(config=config)
        cfg = config.k3
        self.tp_group = pg_collection.tp
        self.beta, self.linear_beta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.linear_fc1 = ColumnParallel(cfg.hidden_size, 2 * intermediate_size, config, self.tp_group)
        self.linear_fc2 = RowParallel(intermediate_size, cfg.hidden_size, config, self.tp_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(hidden, self.config, self.tp_group)
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(situ(gate, up, self.beta, self.linear_beta))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {"linear_fc1.weight": 0, "linear_fc2.weight": 1}
        return tp_sharded_state_dict(self, prefix, axes, sharded_offsets, metadata, self.tp_group,
                                     fused_halves=("linear_fc1.weight",))


class K3DenseMLP(K3SiTUMLP):
    """The dense MLP (layers before ``first_k_dense_replace``), width ``intermediate_size``."""

    def __init__(self, config: K3TransformerConfig, layer_number: int = 1, pg_collection=None) -> None:
        super().__init__(config, config.k3.intermediate_size, pg_collection)


class K3SharedExperts(K3SiTUMLP):
    """The MoE layers' shared experts: one SiTU MLP of ``num_shared_experts × moe_intermediate_size``."""

    def __init__(self, config: K3TransformerConfig, pg_collection=None) -> None:
        super().__init__(config, config.k3.shared_expert_intermediate_size, pg_collection)
