"""Merge adapters into the base weights (``W + (alpha/r)·B A``) and undo it bit-exactly.

Merging computes the delta in float32 and rounds ``W + delta`` once to the weight's dtype. Because that
rounding cannot be inverted by subtraction, ``merge_lora`` keeps a copy of each original weight (on the
weight's device unless ``backup_device`` says otherwise) and ``unmerge_lora`` puts it back, so the base
after a merge/unmerge cycle is bit-identical. While merged, the adapter path is skipped (its factors get no
gradient): merge for evaluation or serving, not for training.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.lora.apply import lora_modules
from k3.lora.linear import LoRALinear

__all__ = ["merge_lora", "unmerge_lora", "is_merged"]

_BACKUP = "_lora_unmerged"  # module attribute: {weight name: original tensor}


def is_merged(model: nn.Module) -> bool:
    """Whether the model's adapters are merged (all or none are; a mix raises)."""
    states = {m.merged for _, m in lora_modules(model)}
    if len(states) > 1:
        raise RuntimeError("some LoRA modules are merged and some are not")
    return states == {True}


@torch.no_grad()
def merge_lora(model: nn.Module, backup_device: torch.device | str | None = None) -> nn.Module:
    """Fold every adapter into its base weight; returns ``model``. Raises if already merged or no adapters."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("merge_lora: the model has no LoRA adapters")
    if is_merged(model):
        raise RuntimeError("merge_lora: the adapters are already merged")
    for _, m in modules:
        deltas = {"weight": m.delta_weight()} if isinstance(m, LoRALinear) else m.delta_weights()
        backup = {}
        for name, delta in deltas.items():
            w: torch.Tensor = getattr(m, name)
            backup[name] = w.detach().to(backup_device or w.device, copy=True)
            w.copy_((w.float() + delta).to(w.dtype))
        setattr(m, _BACKUP, backup)
        m.merged = True
    return model


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> nn.Module:
    """Restore the exact pre-merge base weights; returns ``model``. Raises if not merged."""
    modules = lora_modules(model)
    if not modules or not is_merged(model):
        raise RuntimeError("unmerge_lora: the adapters are not merged")
    for _, m in modules:
        for name, original in getattr(m, _BACKUP).items():
            getattr(m, name).copy_(original)
        delattr(m, _BACKUP)
        m.merged = False
    return model

