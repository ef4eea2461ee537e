"""LoRA adapters for K3: dense/attention ``LoRALinear``, shared-outer ``LoRALatentExperts``, export to PEFT names.

    from k3.lora import LoRAConfig, apply_lora
    model = apply_lora(model, LoRAConfig(rank=16, alpha=32))      # freezes the base, attaches adapters
    from k3.lora.export import export_chunks
    for chunk in export_chunks(model, version=1): ...             # one chunk per module group

``LoRAConfig`` and the target table live in ``k3.settings.lora``; every module here reads that table.
"""

from k3.lora.apply import apply_lora, has_lora, lora_modules, lora_parameter_counts
from k3.settings.lora import LoRAConfig, LoRAConfigError

__all__ = ["LoRAConfig", "LoRAConfigError", "apply_lora", "has_lora", "lora_modules", "lora_parameter_counts"]
