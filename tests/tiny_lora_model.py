"""The tiny K3 with rank-4 LoRA on the recipe's targets and every B factor non-zero (seeded), so every factor gets a
gradient from the first step: the model the torch trainer's unit tests train."""

from __future__ import annotations

import torch

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.model import KimiK3ForCausalLM


def tiny_lora_model(seed: int = 0) -> KimiK3ForCausalLM:
    torch.manual_seed(seed)
    model = apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=4, alpha=8))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model
