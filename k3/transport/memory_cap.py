"""The GPU memory cap of one actor (``--gpu-memory-fraction-per-actor``): the share of its device that the actor's
CUDA caching allocator may reserve.

Each colocated actor (a trainer rank, the embedded engine) applies it once, when it starts, before it allocates
anything: ``torch.cuda.set_per_process_memory_fraction(fraction, device)``. From then on an allocation that would
take the process's reserved memory past ``fraction × total`` raises ``torch.OutOfMemoryError`` in that actor. It is
a per-process limit: two actors on one GPU with a cap of 0.6 each can still hold 1.2 of the device between them, so
what keeps a trainer and an engine from being resident together is the device's own size (``make smoke-gpu`` shrinks
that to a budget; see ci/smoke_gpu.sh). It lives beside the leak gate: both account for what an actor holds on its
device around the hand-off.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MemoryCapError", "apply_gpu_memory_fraction"]

_GIB = 1024**3


class MemoryCapError(RuntimeError):
    """A cap that cannot be applied where the actor runs; the message names the flag and what to change."""


def apply_gpu_memory_fraction(fraction: float | None, device: str | torch.device, who: str) -> str | None:
    """Cap this process's CUDA allocator on ``device`` at ``fraction`` of the device's memory; None: no cap.

    ``who`` names the actor in messages ("trainer rank 0", "embedded engine"). Returns the line the actor prints
    ("embedded engine: GPU memory capped at 0.2 of cuda:0 (28.0 of 139.8 GiB)"), or None without a cap. Raises
    :class:`MemoryCapError` when ``device`` is not a CUDA device (the cap is a CUDA allocator limit: a CPU worker
    cannot honour it, and a printed cap must be one in effect) and ``ValueError`` for a fraction outside (0, 1].
    """
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not math.isfinite(fraction) or not (
            0.0 < fraction <= 1.0):
        raise ValueError(f"--gpu-memory-fraction-per-actor {fraction!r}: must be a number in (0, 1]")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise MemoryCapError(f"{who}: --gpu-memory-fraction-per-actor {fraction} caps a CUDA allocator, and this actor "
                             f"runs on {dev} (no CUDA device here?): drop the flag, or run where torch sees a GPU")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(float(fraction), index)
    total = torch.cuda.get_device_properties(index).total_memory
    return (f"{who}: GPU memory capped at {fraction:g} of cuda:{index} "
            f"({fraction * total / _GIB:.1f} of {total / _GIB:.1f} GiB)")
