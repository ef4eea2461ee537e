"""The model a worker serves or trains: the run's BF16 checkpoint with its LoRA adapters attached.

The embedded engine's worker and the torch trainer's worker build it the same way, so both start from the same
adapters (B = 0, A drawn from the run's seed).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.lora import apply_lora
from k3.model import KimiK3ForCausalLM
from k3.settings.worker import WorkerSpec

__all__ = ["load_lora_model"]


def load_lora_model(spec: WorkerSpec) -> nn.Module:
    """``KimiK3ForCausalLM`` of ``spec.model_dir`` on ``spec.device`` in ``spec.dtype``, with ``spec``'s LoRA
    attached (base frozen; the routed experts' adapters run ``spec.expert_lora_kernel``)."""
    model = KimiK3ForCausalLM.from_pretrained(spec.model_dir, dtype=getattr(torch, spec.dtype), device=spec.device)
    torch.manual_seed(spec.seed)  # the LoRA A init is then the same on every rank and every restart
    return apply_lora(model, spec.lora, expert_lora_kernel=spec.expert_lora_kernel)
