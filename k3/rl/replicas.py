"""Which adapter tensors a training rank holds as replicas, and their digests after an optimizer step.

Every adapter factor a rank holds is either a piece of a split factor or a whole replicated one
(``k3.lora.sharding``'s rules, from the parallel styles of ``k3.settings.lora``). Every rank of a pipeline stage
that holds the same piece holds a *replica* of it: a factor split over TP is replicated over the data-parallel
(and context-parallel) ranks; a routed-expert factor split over EP is replicated over TP (ETP = 1) and the
expert-data-parallel ranks; a whole factor — the shared-outer expert A of fc1 and B of fc2, the TP-replicated
dense factors — on every rank of the stage. Optimizer steps keep replicas bit-identical only when every rank
applied the same gradient (the TP / EP sums of ``k3.megatron.grads``, then the data-parallel reduction), so
a replica that differs after a step is a reduction that went wrong (NVIDIA-NeMo/Megatron-Bridge#6009,
radixark/miles#2723).

``replica_digests`` labels each tensor so that two ranks hold replicas of one another iff they give it the same
label: ``<local parameter name>`` for a whole factor, plus ``[tp 1/2]`` / ``[ep 0/4]`` for the piece of a split
one, and ``[pp 1/2]`` for the pipeline stage when there are several. The harness's ``replicas_agree`` criterion
compares the digests of equal labels across ranks (docs/RUN_DIRECTORY.md, the ``replicas`` event).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from k3.lora.digest import tensor_digests
from k3.lora.sharding import factor_rule

__all__ = ["replica_labels", "replica_digests"]


def _pipeline_place() -> tuple[int, int]:
    """(this rank's pipeline stage, stages); (0, 1) outside an initialised megatron."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return 0, 1
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def replica_labels(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of every adapter tensor ``model`` holds on this rank, in model order (see the module
    doc for the labels). Megatron adapters are found by their ``k3_lora_factor`` tag and their module's
    ``ctx``; any other model (the torch backend's, one rank) by the PEFT factor names ``lora_A`` / ``lora_B``,
    whole. A parameter tied to several modules is listed once."""
    stage, stages = _pipeline_place()
    pp = f" [pp {stage}/{stages}]" if stages > 1 else ""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            factor = getattr(p, "k3_lora_factor", None)
            name = f"{module_name}.{pname}" if module_name else pname
            if factor is None and "lora_" not in pname:
                continue
            seen.add(id(p))
            label = name + pp
            ctx = getattr(module, "ctx", None)
            if factor is not None and ctx is not None:
                rule = factor_rule(factor)
                if rule.split_group is not None and ctx.layout.size(rule.split_group) > 1:
                    label += f" [{rule.split_group} {ctx.rank_in(rule.split_group)}/{ctx.layout.size(rule.split_group)}]"
            out.append((label, p.detach()))
    return out


@torch.no_grad()
def replica_digests(model: nn.Module) -> dict[str, Any]:
    """``{label: digest}`` of every adapter tensor this rank holds (``k3.lora.digest.tensor_digest``: exact, on
    the tensor's device, one host copy for all of them)."""
    named = replica_labels(model)
    return dict(zip((label for label, _ in named), tensor_digests([t for _, t in named])))
