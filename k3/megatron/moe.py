"""K3's latent MoE as a megatron module: megatron's router and token dispatcher, K3's latent path and experts.

    probs, map = K3Router(x)                       sigmoid scores, correction bias for selection only, renormalized
    z = fc1_latent_proj(x)                         hidden -> latent, *before* dispatch (the all-to-all moves Lt wide)
    u = combine(experts(dispatch(z)))              stacked local experts, SiTU, output weighted by the probs
    y = fc2_latent_proj(routed_expert_norm(u)) + shared_experts(x)

The routing math is megatron's ``topk_routing_with_score_function`` with the sigmoid score function, which is
the reference router's (``k3.model.moe.Router``). ``K3Router`` is megatron's base ``Router`` (its gate weight)
with a frozen float32 ``expert_bias``; it computes the gate logits in float32 with plain torch (megatron's
``TopKRouter`` gating GEMM reaches for TransformerEngine's ``te_general_gemm``, undefined without TE, and its
token counters for bias updates are not needed: K3's correction bias is frozen). Like ``TopKRouter`` it takes
megatron's routing replay (``moe_enable_routing_replay``, ``RouterReplay``): record each token's top-k experts,
or route on given ones (the probabilities are still the scores of those experts, renormalized). The router,
latent projections and latent norm act per token on the sequence-parallel shard (gradients summed over TP
by megatron under SP); routed experts are expert-parallel with no tensor parallelism (ETP = 1).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from torch import nn

from k3.megatron.config import K3TransformerConfig
from k3.megatron.linears import GroupedExpertLinear, init_normal, mark_sequence_parallel
from k3.megatron.mlp import K3SharedExperts
from k3.megatron.recompute import checkpointed
from k3.megatron.sharded_state import expert_sharded_state_dict
from k3.model.mlp import situ
from k3.model.norm import RMSNorm

__all__ = ["DISPATCH_CALL_STATE", "K3Router", "K3RoutedExperts", "K3LatentMoE", "release_dispatch_state"]

# What megatron-core 0.16.1's dispatchers keep of their last call until the next one: the routing probabilities
# (with their autograd graph, back through the router to the layer's input) and the routing maps. A training step's
# last micro-batch would outlive the step through them: its layer inputs and the router's saved inputs, one set
# per MoE layer, still allocated while the trainer sleeps.
DISPATCH_CALL_STATE = ("probs", "local_probs", "routing_map", "local_map", "reversed_local_input_permutation_mapping")


class K3Router(Router):
    """Sigmoid top-k router: ``weight [E, hidden]`` (model dtype, used in float32), ``expert_bias [E]`` float32
    (the checkpoint's ``e_score_correction_bias``: it picks experts, it never weights them)."""

    def __init__(self, config: K3TransformerConfig, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        cfg = config.k3
        self.topk = cfg.num_experts_per_token
        self.scaling = cfg.routed_scaling_factor
        if not cfg.moe_renormalize:
            raise ValueError("moe_renormalize=false: megatron's sigmoid routing always renormalizes the top-k")
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32,
                                                        device=self.weight.device))
        # megatron's routing replay (moe_enable_routing_replay, as its TopKRouter): record each token's top-k
        # experts, or route on recorded ones; None routes freshly
        self.router_replay = RouterReplay() if config.moe_enable_routing_replay else None

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [tokens, E]`` float32 -> ``(probs [tokens, E], routing_map [tokens, E] bool)``."""
        return topk_routing_with_score_function(
            logits, self.topk, score_function="sigmoid", expert_bias=self.expert_bias.float(),
            scaling_factor=self.scaling, router_replay=self.router_replay)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [s, b, hidden]`` -> ``(probs, routing_map)``, both ``[s·b, E]``."""
        logits = x.reshape(-1, x.shape[-1]).float() @ self.weight.float().t()
        return self.routing(logits)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.expert_bias.data = self.expert_bias.data.float()  # stays float32 through .to(bf16) / Float16Module
        return out


class K3RoutedExperts(nn.Module):
    """The layer's local routed experts: ``linear_fc1`` ``[E_local, 2F, Lt]`` (``[w1; w3]`` per expert) and
    ``linear_fc2`` ``[E_local, Lt, F]``; stored as slices of the global ``[num_experts, …]`` tensors."""

    def __init__(self, config: K3TransformerConfig, num_local_experts: int, pg_collection) -> None:
        super().__init__()
        cfg = config.k3
        Lt, F = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        self.pg_collection = pg_collection
        self.beta, self.linear_beta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.linear_fc1 = GroupedExpertLinear(num_local_experts, Lt, 2 * F, config)
        self.linear_fc2 = GroupedExpertLinear(num_local_experts, F, Lt, config)

    def forward(self, z: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``z [rows, Lt]`` sorted by local expert, ``counts [E_local]``, ``probs [rows]`` -> ``[rows, Lt]``,
        each row's expert output times its routing weight (float32 product, cast back)."""
        counts = counts.to(device=z.device)
        gate, up = self.linear_fc1(z, counts).chunk(2, dim=-1)
        y = self.linear_fc2(situ(gate, up, self.beta, self.linear_beta), counts)
        return (y.float() * probs.float().unsqueeze(-1)).to(y.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return expert_sharded_state_dict(self, prefix, self.pg_collection)


class K3LatentMoE(MegatronModule):
    """One latent-MoE FFN; ``hidden [s/tp, b, hidden]`` (SP) or ``[s, b, hidden]`` in and out."""

    def __init__(self, config: K3TransformerConfig, layer_number: int = 1, pg_collection=None) -> None:
        super().__init__(config=config)
        cfg = config.k3
        H, Lt = cfg.hidden_size, cfg.routed_expert_hidden_size
        ep = pg_collection.ep
        self.num_local_experts = cfg.num_experts // ep.size()
        local_experts = list(range(ep.rank() * self.num_local_experts, (ep.rank() + 1) * self.num_local_experts))
        self.router = K3Router(config=config, pg_collection=pg_collection)
        self.router.set_layer_number(layer_number)
        self.fc1_latent_proj = nn.Linear(H, Lt, bias=False, dtype=config.params_dtype)
        self.experts = K3RoutedExperts(config, self.num_local_experts, pg_collection)
        self.routed_expert_norm = (RMSNorm(Lt, cfg.rms_norm_eps, dtype=config.params_dtype)
                                   if cfg.latent_moe_use_norm else None)
        self.fc2_latent_proj = nn.Linear(Lt, H, bias=False, dtype=config.params_dtype)
        self.shared_experts = K3SharedExperts(config, pg_collection) if cfg.num_shared_experts else None
        for m in (self.fc1_latent_proj, self.fc2_latent_proj, self.routed_expert_norm):
            if m is not None:
                mark_sequence_parallel(m, config)
        if config.perform_initialization:
            init_normal(self.fc1_latent_proj.weight)
            init_normal(self.fc2_latent_proj.weight)
        dispatcher = {"alltoall": MoEAlltoAllTokenDispatcher,
                      "allgather": MoEAllGatherTokenDispatcher}[config.moe_token_dispatcher_type]
        self.token_dispatcher = dispatcher(self.num_local_experts, local_experts, config=config,
                                           pg_collection=pg_collection)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (post-attention normed) -> the FFN output, same layout."""
        probs, routing_map = self.router(hidden)
        z = self.fc1_latent_proj(hidden)
        d = self.token_dispatcher
        z, probs = d.dispatch_preprocess(z, routing_map, probs)
        z, probs = d.token_dispatch(z, probs)
        z, counts, permuted_probs = d.dispatch_postprocess(z, probs)
        u = d.combine_postprocess(d.token_combine(d.combine_preprocess(self.experts(z, counts, permuted_probs))))
        release_dispatch_state(d)
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        y = self.fc2_latent_proj(u)
        if self.shared_experts is not None:
            y = y + checkpointed(self.config, "shared_experts", self.training, self.shared_experts, hidden)
        return y


def release_dispatch_state(dispatcher) -> None:
    """Drop what ``dispatcher`` keeps of its last call (:data:`DISPATCH_CALL_STATE`), once the combine has used
    it: the autograd graph holds what the backward needs, and the next call sets them anew."""
    for name in DISPATCH_CALL_STATE:
        if getattr(dispatcher, name, None) is not None:
            setattr(dispatcher, name, None)
