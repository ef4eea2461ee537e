"""SiTU-GLU feed-forward: the dense MLP of layer 0 and the shared experts of the MoE layers.

``SiTU(g, u) = [β1·tanh(g/β1)·σ(g)] ⊙ [β2·tanh(u/β2)]`` (β1 = 4, β2 = 25, so |SiTU| ≤ β1·β2 = 100), computed
in float32 and cast back (architecture §2.4). The soft tanh clip is the point: a hard clip is not the same
function. ``situ`` is ``k3.kernels.situ.situ``: the plain form (``naive.py``) everywhere but in the embedded engine's
window-mode decode on CUDA, which asks for the same math in one Triton kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.kernels.situ import situ

__all__ = ["situ", "DenseMLP", "SharedExperts"]


class DenseMLP(nn.Module):
    """``down_proj(SiTU(gate_proj x, up_proj x))``: hidden -> intermediate -> hidden."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, linear_beta: float) -> None:
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> ``[..., hidden]``."""
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


class SharedExperts(DenseMLP):
    """The MoE layers' shared experts: one SiTU MLP of width ``num_shared_experts × moe_intermediate_size``
    on the full hidden state (a separate class so adapters can target it by type)."""
