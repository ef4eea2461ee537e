"""Whether the fused Triton forms of the model's small ops (``k3.kernels.rms_norm``, ``situ``, ``attn_res_mix``,
``head_norms``) are wanted: off unless a caller turns them on for a block of code.

The model always calls the ops' dispatch; the dispatch takes the Triton kernel only inside ``triton_small_ops()``,
for tensors the kernels run on (CUDA with Triton; the CPU under Triton's interpreter, which is how the CPU tests
reach it) that carry no gradient (``triton_serves``). Who turns it on: the embedded engine around a
window-mode decode (``DecodeSettings.small_ops``), where a step is hundreds of tiny kernels and each fused op
saves several launches. Training and the trainer's log-prob passes never do, so their numbers are the reference's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from k3.kernels.availability import triton_runs_on

__all__ = ["triton_small_ops", "triton_small_ops_on", "triton_serves"]

_ON: ContextVar[bool] = ContextVar("k3_triton_small_ops", default=False)


@contextlib.contextmanager
def triton_small_ops(on: bool = True) -> Iterator[None]:
    """Within the block, the dispatch of the small ops may take their Triton kernels (``on``) or not."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def triton_small_ops_on() -> bool:
    """True inside ``triton_small_ops()`` (with ``on``)."""
    return _ON.get()


def triton_serves(*tensors: torch.Tensor) -> bool:
    """Whether an op's Triton kernel takes ``tensors`` (its inputs): inside ``triton_small_ops()``, where the
    kernels run on their device, with no gradient to carry (the kernels have no backward)."""
    return (triton_small_ops_on() and triton_runs_on(tensors[0].device)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
