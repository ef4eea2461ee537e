"""Memory readings of a worker process: what the run's ``memory`` events hold (docs/RUN_DIRECTORY.md, "memory").

Two numbers matter in colocation (recipe §5.6, issue #21):

* **allocated** — on CUDA ``torch.cuda.memory_allocated``: the recipe's ``allocated_GB``. Memory paused by
  torch_memory_saver keeps its virtual allocation, so a sleeping trainer's allocated stays at its footprint. On
  CPU there is no allocator to ask: the caller passes the bytes it knows are materialised (the trainer's resident
  parameters and gradient buffers, ``k3.rl.trainers.memory_regions``).
* **physical** — on CUDA the device's total − free (``torch.cuda.mem_get_info``): the whole GPU, every process on
  it included; it is what a colocated engine can still take. On CPU the process RSS.

GB here is GiB (``bytes / 2**30``), what the recipe's ``print_memory`` calls GB.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

__all__ = ["GIB", "DeviceMemoryError", "default_pool_usage", "is_out_of_memory", "memory_note", "memory_reading",
           "physical_bytes", "resolved_memory_device"]

GIB = 1024**3


def resolved_memory_device(device: torch.device | str) -> torch.device:
    """``device`` with a CUDA index filled in (the current device when it has none)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def physical_bytes(device: torch.device | str) -> int:
    """Bytes physically in use: on CUDA the device's total − free (all processes on it), else the RSS of this
    process."""
    device = resolved_memory_device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    return int(psutil.Process().memory_info().rss)


def memory_reading(phase: str, device: torch.device | str, resident_bytes: int | None = None,
                   **extra: Any) -> dict[str, Any]:
    """One ``memory`` event record (without ``rollout_id``/``sync``: the loop adds them) for ``phase``.

    CUDA: ``memory/allocated_gb`` = ``torch.cuda.memory_allocated`` (after a device sync), ``memory/reserved_gb``,
    ``memory/peak_allocated_gb`` = the most this process had allocated at any moment since its previous reading
    (the peak counter is reset here: the reading after a training step holds that step's peak),
    ``memory/physical_gb`` = total − free. CPU: ``memory/allocated_gb`` = ``resident_bytes`` (left out when None:
    an engine reading has no allocated), ``memory/physical_gb`` = the process RSS. ``memory/rss_gb`` always.
    ``extra`` (e.g. ``rank=0``) is added as is."""
    device = resolved_memory_device(device)
    rss = psutil.Process().memory_info().rss
    record: dict[str, Any] = {"event": "memory", "phase": phase, "device": str(device)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        record["memory/allocated_gb"] = torch.cuda.memory_allocated(device) / GIB
        record["memory/reserved_gb"] = torch.cuda.memory_reserved(device) / GIB
        record["memory/peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    elif resident_bytes is not None:
        if resident_bytes < 0:
            raise ValueError(f"memory_reading: resident_bytes={resident_bytes} is negative")
        record["memory/allocated_gb"] = resident_bytes / GIB
    record["memory/physical_gb"] = physical_bytes(device) / GIB
    record["memory/rss_gb"] = rss / GIB
    record.update(extra)
    return record


DEFAULT_POOL = (0, 0)  # the caching allocator's own pool; private pools (torch_memory_saver's regions, graphs) differ
LARGEST_SHOWN = 5


def default_pool_usage(device: torch.device | str) -> dict[str, Any]:
    """What this process's ordinary caching allocator holds on ``device`` (CUDA), outside every private memory pool
    such as torch_memory_saver's regions: ``memory/default_pool_allocated_gb`` (live blocks),
    ``memory/default_pool_reserved_gb`` (its segments, which ``empty_cache`` cannot return while a live block sits
    in them) and ``default_pool_largest_mb``, the largest live blocks (MiB). A sleeping trainer keeps exactly this
    on the device, so these say what its residue is made of (the first H100 smoke-gpu run kept 1.46 GB)."""
    device = resolved_memory_device(device)
    segments = [s for s in torch.cuda.memory_snapshot() if s["device"] == device.index
                and tuple(s.get("segment_pool_id", DEFAULT_POOL)) == DEFAULT_POOL]
    live = sorted((b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"),
                  reverse=True)
    return {"memory/default_pool_allocated_gb": sum(live) / GIB,
            "memory/default_pool_reserved_gb": sum(s["total_size"] for s in segments) / GIB,
            "default_pool_largest_mb": [round(n / 2**20, 1) for n in live[:LARGEST_SHOWN]]}


class DeviceMemoryError(RuntimeError):
    """A worker ran out of device memory; the message adds what the device and the process held at that moment."""


# How an allocation failure reads when it does not come as torch.OutOfMemoryError: NCCL's own allocations surface
# as DistBackendError ("Failed to CUDA calloc async 4 bytes", seen on the H200), the driver's as its error names.
_OOM_TEXT = ("out of memory", "failed to cuda calloc", "failed to cuda malloc", "cuda_error_out_of_memory",
             "cudaerrormemoryallocation")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a failed device allocation."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or any(t in str(e).lower() for t in _OOM_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def memory_note(device: torch.device | str) -> str:
    """One line on what ``device`` and this process hold now (GiB): for an out-of-memory message, or a progress line
    where memory is tight. Reading a device that has just failed an allocation can fail too: the line then says so
    instead."""
    try:
        device = resolved_memory_device(device)
        if device.type != "cuda":
            return f"this process's RSS {psutil.Process().memory_info().rss / GIB:.2f} GiB"
        free, total = torch.cuda.mem_get_info(device)
        return (f"{device} had {free / GIB:.2f} of {total / GIB:.2f} GiB free; this process allocated "
                f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB (peak "
                f"{torch.cuda.max_memory_allocated(device) / GIB:.2f} since its last memory reading), reserved "
                f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB")
    except Exception as e:  # noqa: BLE001 - a note on a failure must not replace the failure
        return f"the memory of {device} could not be read ({type(e).__name__}: {e})"
