"""Sharded state dicts (megatron ``dist_checkpointing``) of the K3 modules.

Every K3 tensor is stored whole under its global name (``k3.checkpoint.names``); a rank contributes its
slice: TP-split tensors along their split axis, fused ``[gate; up]`` weights as two TP-split halves (megatron's
swiglu factory), stacked routed experts along the expert axis over EP. Replicated tensors are written by one
replica. LoRA adapters are never part of it (the base checkpoint has none).
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from torch import nn

from k3.megatron.linears import without_adapters

__all__ = ["tp_sharded_state_dict", "expert_sharded_state_dict"]


def tp_sharded_state_dict(
    module: nn.Module,
    prefix: str,
    tp_axes: dict[str, int],
    sharded_offsets: tuple,
    metadata: dict | None,
    tp_group,
    fused_halves: tuple[str, ...] = (),
) -> ShardedStateDict:
    """``module``'s tensors as ShardedTensors: ``tp_axes`` maps local state-dict names to their TP split axis
    (every other tensor is replicated); names in ``fused_halves`` are ``[gate; up]`` weights split per half."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    state = without_adapters(module.state_dict(prefix="", keep_vars=True))
    sharded = make_sharded_tensors_for_checkpoint(
        state, prefix, tp_axes, sharded_offsets, tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])
    for name in fused_halves:
        sharded[prefix + name] = apply_swiglu_sharded_factory(sharded[prefix + name], sharded_offsets)
    return sharded


def expert_sharded_state_dict(module: nn.Module, prefix: str, pg_collection) -> ShardedStateDict:
    """Stacked expert weights ``[local_experts, …]`` as slices of ``[num_experts, …]`` along dim 0 over EP,
    written by the first expert-data-parallel replica."""
    ep, edp = pg_collection.ep, pg_collection.expt_dp
    out: ShardedStateDict = {}
    for name, tensor in without_adapters(module.state_dict(prefix="", keep_vars=True)).items():
        if name.endswith("_extra_state"):
            continue
        out[prefix + name] = ShardedTensor.from_rank_offsets(
            prefix + name, tensor, (0, ep.rank(), ep.size()), replica_id=(0, 0, edp.rank()))
    return out
