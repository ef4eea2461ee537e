"""``get_k3_spec``: the megatron block spec of one pipeline stage of K3.

Each layer of the stage gets ``K3TransformerLayer`` with KDA or MLA attention and the dense MLP or the latent
MoE, decided by the layer's *global* index (the stage's layer offset + local index), so any PP split places the
same modules as the unsplit model. The stage's first and last layers unpack / pack the AttnRes bank when the
stage boundary falls inside the model.
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from k3.megatron.config import K3TransformerConfig
from k3.megatron.kda import K3KDAttention
from k3.megatron.layer import K3LayerSubmodules, K3RMSNorm, K3TransformerLayer
from k3.megatron.mla import K3MLAttention
from k3.megatron.mlp import K3DenseMLP
from k3.megatron.moe import K3LatentMoE

__all__ = ["get_k3_spec", "stage_layers"]


def stage_layers(config: K3TransformerConfig, pp_rank: int | None = None) -> list[int]:
    """0-based global indices of the layers pipeline stage ``pp_rank`` builds (default: this rank's stage)."""
    if config.virtual_pipeline_model_parallel_size not in (None, 1):
        raise ValueError("K3 does not support virtual pipeline parallelism (as the recipe: VPP is rejected)")
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    n = get_num_layers_to_build(config, None, pp_rank)
    offset = get_transformer_layer_offset(config, None, pp_rank)
    return list(range(offset, offset + n))


def get_k3_spec(config: K3TransformerConfig, pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """Layer specs for pipeline stage ``pp_rank`` (default: this rank's) and the final norm."""
    cfg = config.k3
    if cfg is None:
        raise ValueError("get_k3_spec: config.k3 is None; build the config with k3_transformer_config(cfg, ...)")
    layers = stage_layers(config, pp_rank)
    last = cfg.num_hidden_layers - 1
    specs = []
    for j, i in enumerate(layers):
        attention = K3KDAttention if cfg.is_kda_layer(i) else K3MLAttention
        mlp = K3LatentMoE if cfg.is_moe_layer(i) else K3DenseMLP
        specs.append(ModuleSpec(
            module=K3TransformerLayer,
            submodules=K3LayerSubmodules(self_attention=attention, mlp=mlp),
            params={"unpack_input": j == 0 and i > 0, "pack_output": j == len(layers) - 1 and i < last},
        ))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=K3RMSNorm)
