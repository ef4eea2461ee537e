"""Where k3's Triton kernels can run: a CUDA device with Triton, or the CPU under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before the kernels are imported: Triton decides when a kernel is defined
whether it is interpreted, so the flag is read once, here, and every module of the op follows this reading.
Triton 3.6's interpreter needs numpy < 2.4 (triton-lang/triton#9171: a kernel's scalar argument in ``range``
raises "only 0-dimensional arrays can be converted to Python scalars").
"""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRETING", "triton", "triton_available", "triton_runs_on"]

try:
    import triton
except Exception:  # noqa: BLE001 - ImportError, or a broken Triton install: the torch path serves
    triton = None

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """True when the kernels exist (running them also needs a CUDA device, or ``TRITON_INTERPRET=1``)."""
    return triton is not None


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA with Triton, or the CPU under the interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    if device.type == "cuda":
        return not INTERPRETING  # the interpreter runs kernels on host memory only
    return device.type == "cpu" and INTERPRETING
