"""What the megatron layout parity tests share: the GRPO trajectories they train on, and the checks that a
layout's Adam steps equal TP1's (losses, every LoRA gradient, the final adapters).

Tolerances. float32 with another reduction order differs by ~1e-5 relative at step 1, and Adam's normalisation
lets that grow over the steps (``GRAD_TOLS``); a wrong reduction (a missing or a doubled sum) is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

ADVANTAGES = (1.0, -0.5, 0.7, -1.2, 0.3, -0.3)
GRAD_TOLS = (2e-4, 3e-3, 1e-2)  # relative, LoRA gradients at steps 1, 2, 3
LOSS_REL = 2e-6
ADAPTER_REL = 1e-3


def trajectories(vocab: int, advantages: tuple[float, ...] = ADVANTAGES) -> list:
    """One ``Trajectory`` per advantage: prompts of 2-5 and responses of 1-7 tokens drawn from seed 5."""
    from k3.rl.trainers.trajectory import Trajectory

    gen = torch.Generator().manual_seed(5)
    out = []
    for k, adv in enumerate(advantages):
        p, n = 2 + k % 4, 1 + (3 * k) % 7
        ids = torch.randint(3, vocab, (p + n,), generator=gen).tolist()
        out.append(Trajectory(ids[:p], ids[p:], adv))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_losses_equal(got: list[float], base: list[float], steps: int) -> None:
    """``steps`` losses, each within ``LOSS_REL`` of TP1's, and TP1's adapters learn (the last below the first)."""
    assert len(got) == steps and base[-1] < base[0]
    for a, b in zip(got, base):
        assert a == pytest.approx(b, rel=LOSS_REL)


def assert_gradients_equal(got: list[dict], base: list[dict], steps: int) -> None:
    """Per step the same LoRA gradient names, each non-zero in TP1 and within that step's ``GRAD_TOLS``."""
    for step, tol in zip(range(steps), GRAD_TOLS):
        assert sorted(got[step]) == sorted(base[step])
        for name in base[step]:
            assert base[step][name].norm() > 0, name
            assert rel(got[step][name], base[step][name]) < tol, (step, name)


def assert_adapters_equal(got: dict, base: dict) -> None:
    """Every final adapter factor within ``ADAPTER_REL`` of TP1's."""
    for name in base:
        assert rel(got[name], base[name]) < ADAPTER_REL, name
