"""Kimi Delta Attention (architecture §2.2): the 69 linear-attention layers of K3.

    q, k, v = SiLU(causal depthwise conv_4(W_{q,k,v} x))        per head; q, k L2-normalised (eps 1e-6)
    β       = sigmoid(b_proj x)                                  float32, one per head
    g       = gate(f_b(f_a x) + dt_bias, A_log)                  float32 log decay per key channel
    o       = KDA core(q · K^-½, k, v, g, β)                     delta rule on a float32 state
    y       = o_proj(RMSNorm_head(o) · o_norm · sigmoid(g_proj x))

With ``gate_lower_bound = lb`` (K3, lb = −5) the gate is ``lb · sigmoid(exp(A_log) · z)``; without it,
``−exp(A_log) · softplus(z)``. The bound swaps the function; it is not a clamp of the softplus form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.kernels.kda.fla import kda_core
from k3.kernels.head_norms import l2_norm
from k3.kernels.kda.gate import kda_gate
from k3.model.cache import KDALayerState
from k3.model.norm import GatedRMSNorm
from k3.model.precision import KeepsFloat32

__all__ = ["KDAttention", "CausalConv1d", "kda_gate", "l2_normalize"]

L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dim, float32 (fla's l2norm: eps inside the root;
    ``k3.kernels.head_norms``: its ``naive.py`` is the math, one Triton kernel in the engine's window-mode decode)."""
    return l2_norm(x, eps)


class CausalConv1d(KeepsFloat32):
    """Depthwise causal convolution over time with a carried history; ``weight [channels, 1, kernel]`` F32."""

    float32_params = ("weight",)

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve new inputs after ``history``.

        Args:
            x: ``[batch, seq, channels]`` new inputs.
            history: ``[batch, channels, kernel − 1]`` the previous inputs (None = zeros, a fresh sequence).

        Returns:
            ``(y [batch, seq, channels] float32, new history [batch, channels, kernel − 1] float32)``.
        """
        b, s, c = x.shape
        if history is None:
            history = x.new_zeros(b, c, self.kernel_size - 1, dtype=torch.float32)
        window = torch.cat([history.float(), x.float().transpose(1, 2)], dim=-1)
        y = F.conv1d(window, self.weight, groups=c)  # [b, c, s]: valid positions only
        return y.transpose(1, 2), window[..., window.shape[-1] - (self.kernel_size - 1):]


class KDAttention(KeepsFloat32):
    """One KDA layer. Names and shapes are the HF checkpoint's (``self_attn.*``)."""

    float32_params = ("A_log", "dt_bias")

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        la = cfg.linear_attn_config
        H, P = cfg.hidden_size, cfg.kda_proj_size
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = la.num_heads, la.head_dim
        self.lower_bound = la.gate_lower_bound
        self.a_log_stored_len = cfg.a_log_stored_len
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.q_conv1d = CausalConv1d(P, la.short_conv_kernel_size)
        self.k_conv1d = CausalConv1d(P, la.short_conv_kernel_size)
        self.v_conv1d = CausalConv1d(P, la.short_conv_kernel_size)
        self.f_a_proj = nn.Linear(H, la.head_dim, bias=False)
        self.f_b_proj = nn.Linear(la.head_dim, P, bias=False)
        self.b_proj = nn.Linear(H, la.num_heads, bias=False)
        self.g_proj = nn.Linear(H, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(la.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(la.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, H, bias=False)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None,
                state: KDALayerState | None = None) -> torch.Tensor:
        """One KDA layer.

        Args:
            x: ``[batch, seq, hidden]`` normed layer input.
            token_mask: ``[batch, seq]`` bool, False at padding; padded positions write nothing to the
                state (zero q/k/v, no decay, β = 0).
            state: carried conv/recurrent state, updated (rebound in a ``K3Cache``, copied into the preallocated
                tensors of a ``StaticK3Cache``); None for a standalone sequence.

        Returns:
            ``[batch, seq, hidden]``.
        """
        b, s, _ = x.shape
        heads = (b, s, self.num_heads, self.head_dim)

        def short_conv(proj: nn.Linear, conv: CausalConv1d, history: torch.Tensor | None):
            inputs = proj(x)
            if token_mask is not None:
                inputs = inputs.masked_fill(~token_mask.unsqueeze(-1), 0.0)
            y, new_history = conv(inputs, history)
            return F.silu(y).to(x.dtype).view(heads), new_history

        q, conv_q = short_conv(self.q_proj, self.q_conv1d, state.conv_q if state else None)
        k, conv_k = short_conv(self.k_proj, self.k_conv1d, state.conv_k if state else None)
        v, conv_v = short_conv(self.v_proj, self.v_conv1d, state.conv_v if state else None)
        q, k = l2_normalize(q), l2_normalize(k)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if token_mask is not None:
            g = g.masked_fill(~token_mask[:, :, None, None], 0.0)
            beta = beta.masked_fill(~token_mask[:, :, None], 0.0)
        o, recurrent = kda_core(q, k, v, g, beta, scale=self.head_dim**-0.5,
                                initial_state=state.recurrent if state else None)
        o = self.o_norm(o, self.g_proj(x).view(heads), out_dtype=x.dtype)
        if state is not None:
            state.store(recurrent, conv_q, conv_k, conv_v)
        return self.o_proj(o.reshape(b, s, -1))

    # ---------------------------------------------------------------- A_log stored padded (architecture §3)
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        a_log = destination[prefix + "A_log"]
        pad = self.a_log_stored_len - a_log.shape[0]
        if pad > 0:
            destination[prefix + "A_log"] = torch.cat([a_log, a_log.new_zeros(pad)])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "A_log"
        stored = state_dict.get(key)
        if stored is not None and stored.dim() == 1 and stored.shape[0] > self.num_heads:
            tail = stored[self.num_heads:]
            if not tail.is_meta and bool(tail.ne(0).any()):
                error_msgs.append(f"{key}: stored with {stored.shape[0]} entries whose padding past the "
                                  f"{self.num_heads} heads is not zero; expected {self.num_heads} real + zeros")
            state_dict[key] = stored[: self.num_heads].clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
