"""The tiny K3 as an HF checkpoint for tests that train it, and the inputs of a tiny `k3 train` run (test-only;
importable by test worker processes)."""

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


def write_tiny_run_inputs(root: Path, n_train: int = 64, n_eval: int = 8) -> Path:
    """What a tiny `k3 train --task arith` reads, under ``root``: the plain tiny K3 (seed 0) in ``base/`` and an arith
    dataset (seed 0) in ``data/arith/``; returns ``root``."""
    from k3.config import variant
    from k3.model import KimiK3ForCausalLM
    from k3.rl.data.arith import write_arith_dataset

    torch.manual_seed(0)
    KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).save_pretrained(root / "base")
    write_arith_dataset(root / "data" / "arith", n_train=n_train, n_eval=n_eval, seed=0)
    return root
