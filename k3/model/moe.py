"""Stable LatentMoE (architecture §2.5): a sigmoid router on the full hidden state, routed experts that run in
a narrower latent space, and shared experts on the full width.

    s      = sigmoid(W_r x)                            float32
    T      = top-k(s + e_score_correction_bias)        the bias picks experts, it never weights them
    p      = s[T] / (Σ s[T] + 1e-20) · routed_scaling_factor
    z      = routed_expert_down_proj x                 hidden -> latent
    u      = Σ_{e∈T} p_e · w2_e(SiTU(w1_e z, w3_e z))   float32 sum of the experts' outputs
    y      = routed_expert_up_proj(routed_expert_norm(u)) + shared_experts(x)

The experts run batched: token copies are sorted by expert and go through one grouped GEMM per weight.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from k3.config import K3Config
from k3.kernels.grouped_mm import grouped_mm
from k3.model.mlp import SharedExperts, situ
from k3.model.norm import RMSNorm
from k3.model.precision import KeepsFloat32

__all__ = ["Router", "LatentExperts", "LatentMoE"]


class Router(KeepsFloat32):
    """Sigmoid top-k router. ``weight [E, hidden]`` follows the model dtype and is used in float32;
    ``e_score_correction_bias [E]`` is float32 and only shifts the selection."""

    float32_params = ("e_score_correction_bias",)

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [tokens, hidden]`` -> ``(experts [tokens, k] long, weights [tokens, k] float32)``."""
        scores = torch.sigmoid(x.float() @ self.weight.float().T)
        chosen = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scaling


_EXPERT_KEY = re.compile(r"^(\d+)\.(w[123])\.weight$")


class LatentExperts(nn.Module):
    """All routed experts of one layer as stacked weights, run as grouped GEMMs over expert-sorted rows.

    Parameters ``w1, w3 [E, F, Lt]`` (gate, up) and ``w2 [E, Lt, F]`` (down), ``F = moe_intermediate_size``,
    ``Lt = routed_expert_hidden_size``. ``state_dict()`` / ``load_state_dict()`` speak the HF per-expert names
    ``{e}.w1.weight`` etc., so a checkpoint loads by name.
    """

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int, beta: float,
                 linear_beta: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.beta, self.linear_beta = beta, linear_beta
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent_size, intermediate_size))

    def gate_up(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [rows, Lt]`` sorted by expert, ``counts [E]`` -> ``(gate [rows, F], up [rows, F])``."""
        return grouped_mm(x, self.w1, counts), grouped_mm(x, self.w3, counts)

    def down(self, h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``h [rows, F]`` sorted by expert -> ``[rows, Lt]``."""
        return grouped_mm(h, self.w2, counts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [rows, Lt]`` sorted by expert (``counts[e]`` rows of expert e) -> ``[rows, Lt]``."""
        return self.down(situ(*self.gate_up(x, counts), self.beta, self.linear_beta), counts)

    # ---------------------------------------------------------------- HF per-expert names
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in ("w1", "w2", "w3"):
            stacked = getattr(self, name)
            stacked = stacked if keep_vars else stacked.detach()
            for e in range(self.num_experts):
                destination[f"{prefix}{e}.{name}.weight"] = stacked[e]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        per_expert: dict[str, dict[int, torch.Tensor]] = {"w1": {}, "w2": {}, "w3": {}}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            m = _EXPERT_KEY.match(key[len(prefix):])
            if m is None:
                continue
            e, name = int(m.group(1)), m.group(2)
            tensor = state_dict.pop(key)
            if e >= self.num_experts:
                unexpected_keys.append(key)
            else:
                per_expert[name][e] = tensor
        reported = set()  # stacked names whose per-expert tensors are already listed as missing or malformed
        for name, found in per_expert.items():
            if prefix + name in state_dict:  # already stacked (e.g. a torch state dict of this module)
                continue
            missing = [e for e in range(self.num_experts) if e not in found]
            if missing:
                missing_keys.extend(f"{prefix}{e}.{name}.weight" for e in missing)
                reported.add(prefix + name)
                continue
            shapes = {tuple(t.shape) for t in found.values()}
            expected = tuple(getattr(self, name).shape[1:])
            if shapes != {expected}:
                error_msgs.append(f"{prefix}*.{name}.weight: shapes {sorted(shapes)}, expected {expected}")
                reported.add(prefix + name)
                continue
            state_dict[prefix + name] = torch.stack([found[e] for e in range(self.num_experts)])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        missing_keys[:] = [k for k in missing_keys if k not in reported]


class LatentMoE(nn.Module):
    """Router + latent routed experts + shared experts (names as the HF ``block_sparse_moe``)."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        H, Lt = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.top_k = cfg.num_experts_per_token
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)
        self.routed_expert_down_proj = nn.Linear(H, Lt, bias=False)
        self.experts = LatentExperts(cfg.num_experts, Lt, cfg.moe_intermediate_size, cfg.activation_situ_beta,
                                     cfg.activation_situ_linear_beta)
        self.routed_expert_norm = RMSNorm(Lt, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.routed_expert_up_proj = nn.Linear(Lt, H, bias=False)
        self.shared_experts = (
            SharedExperts(H, cfg.shared_expert_intermediate_size, cfg.activation_situ_beta,
                          cfg.activation_situ_linear_beta)
            if cfg.num_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` (the post-attention-normed input) -> ``[..., hidden]``."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.gate(x)  # [N, k]
        z = self.routed_expert_down_proj(x)  # [N, Lt]
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # token copies sorted by expert
        token_of_row = order // self.top_k
        # Not bincount: on CUDA it reads the largest id back to the host (a sync, and no CUDA-graph capture).
        counts = flat_experts.new_zeros(self.num_experts).scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        rows = self.experts(z[token_of_row], counts)  # [N*k, Lt]
        row_weights = weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros(x.shape[0], z.shape[-1], dtype=torch.float32, device=x.device)
        combined = combined.index_add(0, token_of_row, rows.float() * row_weights).to(x.dtype)
        if self.routed_expert_norm is not None:
            combined = self.routed_expert_norm(combined)
        y = self.routed_expert_up_proj(combined)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)
