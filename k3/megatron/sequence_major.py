"""Swapping the batch and sequence axes of an activation, with the strides of a freshly made tensor.

Megatron's layers take ``[s, b, hidden]``; K3's attention cores work on ``[b, s, ...]``. Swapping with
``.transpose(0, 1).contiguous()`` is not enough when one of the two axes has size 1 (``b = 1``: every packed
micro-batch): ``contiguous()`` ignores the stride of a size-1 axis, so ``[1, s, h] -> [s, 1, h]`` comes back
unchanged, its size-1 axis still striding ``s·h``. Megatron's linears multiply with ``torch.matmul``, which folds
``[s, b, in] @ [in, out]`` into one GEMM only when each leading stride is the next one's times its size; otherwise
it runs ``s`` batched one-row GEMMs that read the whole weight ``s`` times. Measured on an H100 (2026-12-05,
``bench/gpu_recompute.py``, 4layer width, 4096 packed tokens): each ``o_proj`` took 200 ms that way, 77% of a
training step. :func:`swap_batch_and_sequence` returns the canonical layout (no copy when an axis has size 1).

The same happens in the backward, to the LM head: ``GPTModel`` returns its logits as ``[s, b, vocab].transpose(0,
1).contiguous()``, so the gradient that comes back is a transposed view, and megatron's frozen linear computes the
input gradient with ``torch.matmul(grad, weight)``: one GEMM per token over the 2.35 GB head weight at K3's
vocabulary. :func:`canonical_grad` (a hook on the logits) hands the gradient on in the canonical layout, copying it
only when it is not contiguous at all; :func:`canonical_head_grad` puts it on a model's ``output_layer``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["canonical_grad", "canonical_head_grad", "swap_batch_and_sequence"]


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with the strides ``torch.empty`` would give its shape (a copy only if it is not contiguous)."""
    y = x.contiguous()
    return y.view(-1).view(y.shape)  # a size-1 axis keeps no stale stride


def swap_batch_and_sequence(x: torch.Tensor) -> torch.Tensor:
    """``[a, b, ...] -> [b, a, ...]``, contiguous with the strides ``torch.empty`` would give that shape."""
    return _canonical(x.transpose(0, 1))


def canonical_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, with a hook that passes its gradient back contiguous with canonical strides (module docstring).
    A tensor hook, not an autograd Function: the logits are viewed and changed in place downstream, which a
    Function's output may not be."""
    if x.requires_grad:
        x.register_hook(_canonical)
    return x


def canonical_head_grad(model: nn.Module) -> None:
    """Make ``model.output_layer`` (megatron's LM head, which returns ``(logits, bias)``) receive its output
    gradient in the canonical layout. Nothing to do on a pipeline stage without the head."""
    head = getattr(model, "output_layer", None)
    if head is None:
        return

    def hook(module: nn.Module, args, output):
        logits, *rest = output
        return (canonical_grad(logits), *rest)

    head.register_forward_hook(hook)
