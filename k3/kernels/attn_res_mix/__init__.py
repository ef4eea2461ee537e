"""The Block-AttnRes mix over depth: the reference (``naive``) and one Triton kernel (``triton``), and the dispatch
the model calls. The kernel serves only inside ``k3.kernels.small_ops_mode.triton_small_ops()``, for tensors it
runs on that carry no gradient (``triton_serves``); everything else is the reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.kernels.attn_res_mix.naive import attn_res_mix_naive
from k3.kernels.attn_res_mix.triton import MAX_DIM, attn_res_mix_triton
from k3.kernels.small_ops_mode import triton_serves

__all__ = ["attn_res_mix", "attn_res_mix_naive", "attn_res_mix_triton"]


def attn_res_mix(candidates: Sequence[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Softmax mix over depth (``naive``'s docstring): n candidates ``[..., hidden]`` -> ``[..., hidden]``."""
    if candidates[-1].shape[-1] <= MAX_DIM and triton_serves(*candidates, norm_weight, proj_weight):
        return attn_res_mix_triton(candidates, norm_weight, proj_weight, eps)
    return attn_res_mix_naive(candidates, norm_weight, proj_weight, eps)
