"""The tiny K3 as an HF checkpoint for tests that train it (test-only; importable by test worker processes)."""

from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_checkpoint(root: Path) -> Path:
    """Write the tiny K3 (seed 0, AttnRes queries non-zero so every mix matters) to ``root / "base"``; returns it."""
    from k3.config import variant
    from k3.model import KimiK3ForCausalLM

    torch.manual_seed(0)
    ref = KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "res_proj" in name:
                p.normal_(0.0, 0.5)
    ref.save_pretrained(root / "base")
    return root / "base"
