"""Gradient reductions K3 needs beyond megatron's, run just before ``finalize_model_grads``.

Parameters tagged ``k3_grad_sum`` (``k3.megatron.linears.mark_grad_sum``) hold per-rank shares of their
gradient: duplicated projections and norms inside a TP region and the TP-replicated LoRA factors (``"tp"``),
and the routed experts' shared LoRA factors, which see only the tokens of the rank's local experts (``"ep"``).
``finalize_k3_model_grads`` sums those over their group (one flattened all-reduce per group and dtype) and then
runs megatron's ``finalize_model_grads`` (data-parallel reduction, SP norms, embeddings, token scaling). Set it
as ``config.finalize_model_grads_func``.

The sums must precede the data-parallel reduction: with the distributed optimizer that reduction
reduce-scatters the gradient buffer, after which a rank holds only its slice. So overlapping the gradient
reduction with backward (``overlap_grad_reduce``) is not supported with these parameters.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["reduce_k3_grads", "finalize_k3_model_grads"]


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    g = getattr(param, "main_grad", None)
    return param.grad if g is None else g


def reduce_k3_grads(model: list[torch.nn.Module]) -> None:
    """Sum every ``k3_grad_sum``-tagged gradient over its group (TP or EP), in place."""
    groups = {"tp": parallel_state.get_tensor_model_parallel_group(),
              "ep": parallel_state.get_expert_model_parallel_group()}
    buckets: dict[tuple[str, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for chunk in model:
        for param in chunk.parameters():
            group = getattr(param, "k3_grad_sum", None)
            if group is None or not param.requires_grad:
                continue
            g = _grad(param)
            if g is not None and dist.get_world_size(groups[group]) > 1:
                buckets[(group, g.dtype)].append(g)
    for (group, _), grads in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = _flatten_dense_tensors([g.data for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups[group])
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.data.copy_(synced)


def finalize_k3_model_grads(model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                            pg_collection=None, force_all_reduce: bool = False) -> None:
    """``reduce_k3_grads`` then megatron's ``finalize_model_grads`` (same signature)."""
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_grad_reduce:
            raise ValueError("K3 needs overlap_grad_reduce=False: its TP/EP gradient sums must run before the "
                             "data-parallel reduction (see k3.megatron.grads)")
    reduce_k3_grads(model)
    finalize_model_grads(model, num_tokens=num_tokens, pg_collection=pg_collection,
                         force_all_reduce=force_all_reduce)
