"""The GPU memory cap of one actor: the share of its device (``--gpu-memory-fraction-per-actor``), or the GiB
(``--gpu-memory-gb-per-actor``), that the actor's CUDA caching allocator may reserve.

Each colocated actor (a trainer rank, the embedded engine) applies it once, when it starts, before it allocates
anything: ``torch.cuda.set_per_process_memory_fraction(fraction, device)``, where a cap in GiB becomes the fraction
``GiB × 2^30 / total`` of the actor's own device (so one setting means the same bytes on an 80 GB H100 and a 141 GB
H200). From then on an allocation that would take the process's reserved memory past the cap raises
``torch.OutOfMemoryError`` in that actor. It is a per-process limit: two actors on one GPU with a cap of 0.6 each
can still hold 1.2 of the device between them, so what keeps a trainer and an engine from being resident together
is the device's own size (``make smoke-gpu`` shrinks that to a budget; see ci/smoke_gpu.sh). It lives beside the
leak gate: both account for what an actor holds on its device around the hand-off.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MemoryCapError", "apply_gpu_memory_cap"]

_GIB = 1024**3


class MemoryCapError(RuntimeError):
    """A cap that cannot be applied where the actor runs; the message names the flag and what to change."""


def _positive_number(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


def apply_gpu_memory_cap(device: str | torch.device, who: str, *, fraction: float | None = None,
                         gb: float | None = None) -> str | None:
    """Cap this process's CUDA allocator on ``device`` at ``fraction`` of the device's memory, or at ``gb`` GiB of
    it (at most one of the two); neither: no cap.

    ``who`` names the actor in messages ("trainer rank 0", "embedded engine"). Returns the line the actor prints
    ("embedded engine: GPU memory capped at 0.25 of cuda:0 (35.0 of 139.8 GiB)"; with ``gb``: "… capped at 35 GiB
    of cuda:0 (0.2504 of 139.8 GiB)"), or None without a cap. Raises :class:`MemoryCapError` when ``device`` is not a
    CUDA device (the cap is a CUDA allocator limit: a CPU worker cannot honour it, and a printed cap must be one in
    effect) or when ``gb`` is more than the device has, and ``ValueError`` for a fraction outside (0, 1], a ``gb``
    that is not a positive number, or both given.
    """
    if fraction is None and gb is None:
        return None
    if fraction is not None and gb is not None:
        raise ValueError(f"--gpu-memory-fraction-per-actor {fraction!r} and --gpu-memory-gb-per-actor {gb!r}: "
                         "give one cap, not both")
    if fraction is not None and not (_positive_number(fraction) and fraction <= 1.0):
        raise ValueError(f"--gpu-memory-fraction-per-actor {fraction!r}: must be a number in (0, 1]")
    if gb is not None and not _positive_number(gb):
        raise ValueError(f"--gpu-memory-gb-per-actor {gb!r}: must be a positive number of GiB")
    flag = (f"--gpu-memory-fraction-per-actor {fraction}" if gb is None else f"--gpu-memory-gb-per-actor {gb}")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise MemoryCapError(f"{who}: {flag} caps a CUDA allocator, and this actor runs on {dev} (no CUDA device "
                             "here?): drop the flag, or run where torch sees a GPU")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if gb is not None:
        if gb * _GIB > total:
            raise MemoryCapError(f"{who}: {flag} is more than cuda:{index} has ({total / _GIB:.1f} GiB): lower it")
        fraction = gb * _GIB / total
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        return f"{who}: GPU memory capped at {gb:g} GiB of cuda:{index} ({fraction:.4f} of {total / _GIB:.1f} GiB)"
    torch.cuda.set_per_process_memory_fraction(float(fraction), index)
    return (f"{who}: GPU memory capped at {fraction:g} of cuda:{index} "
            f"({fraction * total / _GIB:.1f} of {total / _GIB:.1f} GiB)")
