"""Swapping the batch and sequence axes of an activation, with the strides of a freshly made tensor.

Megatron's layers take ``[s, b, hidden]``; K3's attention cores work on ``[b, s, ...]``. Swapping with
``.transpose(0, 1).contiguous()`` is not enough when one of the two axes has size 1 (``b = 1``: every packed
micro-batch): ``contiguous()`` ignores the stride of a size-1 axis, so ``[1, s, h] -> [s, 1, h]`` comes back
unchanged, its size-1 axis still striding ``s·h``. Megatron's linears multiply with ``torch.matmul``, which folds
``[s, b, in] @ [in, out]`` into one GEMM only when each leading stride is the next one's times its size; otherwise
it runs ``s`` batched one-row GEMMs that read the whole weight ``s`` times. Measured on an H100 (2026-12-05,
``bench/gpu_recompute.py``, 4layer width, 4096 packed tokens): each ``o_proj`` took 200 ms that way, 77% of a
training step. :func:`swap_batch_and_sequence` returns the canonical layout (no copy when an axis has size 1).
"""

from __future__ import annotations

import torch

__all__ = ["swap_batch_and_sequence"]


def swap_batch_and_sequence(x: torch.Tensor) -> torch.Tensor:
    """``[a, b, ...] -> [b, a, ...]``, contiguous with the strides ``torch.empty`` would give that shape."""
    y = x.transpose(0, 1).contiguous()
    return y.view(-1).view(y.shape)  # a size-1 axis keeps no stale stride
