"""LoRALinear: a frozen ``nn.Linear`` plus a low-rank adapter, ``y = x Wᵀ + (alpha/r) · B A dropout(x)``.

It subclasses ``nn.Linear`` and holds the base ``weight`` under the same name, so a module path such as
``model.layers.3.self_attn.o_proj.weight`` still loads from an HF checkpoint after LoRA is attached; the
adapter adds ``lora_A`` [r, in] (Xavier-uniform) and ``lora_B`` [out, r] (zeros), so a fresh adapter is an
exact no-op. Two modules may share one ``lora_A`` Parameter: the gate and up projections of a dense or
shared-expert MLP do, because the recipe adapts Megatron's fused ``linear_fc1 = [gate; up]`` with one A.
(With dropout > 0 those two draw separate masks where the fused linear draws one; the recipe trains with 0.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRALinear", "new_lora_A", "xavier_bound"]


def xavier_bound(rank: int, fan_in: int) -> float:
    """Xavier-uniform bound for an adapter factor ``[rank, fan_in]``: ``sqrt(6 / (fan_in + rank))``."""
    return (6.0 / (fan_in + rank)) ** 0.5


def new_lora_A(rank: int, in_features: int, like: torch.Tensor) -> nn.Parameter:
    """A fresh ``lora_A`` [rank, in_features], Xavier-uniform, on ``like``'s device and dtype."""
    a = torch.empty(rank, in_features, device=like.device, dtype=like.dtype)
    nn.init.xavier_uniform_(a)
    return nn.Parameter(a)


class LoRALinear(nn.Linear):
    """A bias-free ``nn.Linear`` whose frozen ``weight`` gets a trainable rank-r adapter.

    Args:
        base: the linear to adapt (no bias: every K3 projection is bias-free). Its ``weight`` Parameter is
            reused, not copied, and frozen.
        rank, alpha: the adapter rank and ``lora_alpha``; the delta is scaled by ``alpha / rank``.
        dropout: probability on the adapter input, active in training mode only.
        shared_A: an existing ``lora_A`` [rank, in] to tie to (fc1's gate and up share one); a new one otherwise.

    Forward: ``x [..., in] -> [..., out]``. While ``merged`` (see ``k3.lora.merge``), the delta lives in
    ``weight`` and the adapter path is skipped.
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        shared_A: nn.Parameter | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        if isinstance(base, LoRALinear):
            raise TypeError("this linear already carries a LoRA adapter (apply_lora was called twice?)")
        if base.bias is not None:
            raise ValueError(f"LoRALinear: base linear {base} has a bias; K3 projections are bias-free")
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.register_parameter("bias", None)
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = float(alpha) / rank
        self.dropout = float(dropout)
        if shared_A is None:
            shared_A = new_lora_A(rank, self.in_features, like=self.weight)
        elif tuple(shared_A.shape) != (rank, self.in_features):
            raise ValueError(f"shared lora_A has shape {tuple(shared_A.shape)}: expected {(rank, self.in_features)}")
        self.lora_A = shared_A
        self.lora_B = nn.Parameter(
            torch.zeros(self.out_features, rank, device=self.weight.device, dtype=self.weight.dtype)
        )
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.merged:
            return out
        h = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        return out + self.scale * F.linear(F.linear(h, self.lora_A), self.lora_B)

    def delta_weight(self) -> torch.Tensor:
        """The adapter as a weight, ``(alpha/r) · B @ A`` [out, in], computed in float32."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias=False, "
                f"rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}, merged={self.merged}")
