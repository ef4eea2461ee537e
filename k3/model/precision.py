"""Parameters that stay float32 whatever the model dtype (conv weights, A_log, dt_bias, o_norm, the router's
correction bias): the checkpoint stores them in F32 and rounding them to bf16 measurably changes the KDA
recurrence and the routing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["KeepsFloat32", "is_float32_param"]

# Checkpoint names (architecture §3) whose tensors are F32; everything else follows the model dtype.
FLOAT32_NAME_SUFFIXES = ("conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")


def is_float32_param(name: str) -> bool:
    """Whether the HF tensor ``name`` is stored (and kept) in float32."""
    return name.endswith(FLOAT32_NAME_SUFFIXES)


class KeepsFloat32(nn.Module):
    """A module whose own parameters listed in ``float32_params`` keep float32 through ``.to(dtype)``,
    ``.half()``, ``.bfloat16()``; device moves still apply to them."""

    float32_params: tuple[str, ...] = ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        keep = set()
        for name in self.float32_params:
            p = self._parameters.get(name)
            if p is not None:
                keep.add(id(p))
                if p.grad is not None:
                    keep.add(id(p.grad))

        def apply_keeping_float32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in keep and out.is_floating_point() and out.dtype != torch.float32:
                out = t.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(apply_keeping_float32, recurse)
