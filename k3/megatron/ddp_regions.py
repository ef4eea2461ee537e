"""Megatron's DDP buffers in the trainer's memory regions (recipe §5.1: gradient buffers in a region the memory saver
discards on pause, parameters in the one it backs up).

megatron-core 0.16.1 allocates both of a ``_ParamAndGradBuffer``'s tensors in its ``__init__``: ``grad_data`` always,
``param_data`` under the distributed optimizer (the trainable parameters' ``.data`` become views of it). The recipe
patched that ``__init__``; here :func:`build_ddp_in_regions` builds the whole DDP inside the gradient region, then
moves each ``param_data`` — the adapters' parameters, which the exporter reads from the saver's backups while the
trainer sleeps — into the parameter region (:func:`rehome_param_data`), re-pointing every view of it. The regions
are plain context-manager factories: this module knows nothing of the saver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager

import torch
from megatron.core.distributed import DistributedDataParallel

__all__ = ["Region", "build_ddp_in_regions", "rehome_param_data"]

Region = Callable[[], ContextManager[None]]  # a fresh context manager per call; allocations inside go to the region


def build_ddp_in_regions(make_ddp: Callable[[], DistributedDataParallel], param_region: Region | None = None,
                         grad_region: Region | None = None) -> DistributedDataParallel:
    """``make_ddp()`` run inside ``grad_region`` (its gradient buffers land there), then every ``param_data`` moved to
    ``param_region``. None: no region (the ordinary allocator)."""
    with (grad_region or contextlib.nullcontext)():
        ddp = make_ddp()
    if param_region is not None:
        rehome_param_data(ddp, param_region)
    return ddp


def _buffers(ddp: DistributedDataParallel) -> list:
    return [*ddp.buffers, *ddp.expert_parallel_buffers]


@torch.no_grad()
def rehome_param_data(ddp: DistributedDataParallel, region: Region) -> int:
    """Move each buffer's ``param_data`` (present under the distributed optimizer) into a copy allocated inside
    ``region``, and point the buffer, its buckets and its parameters' ``.data`` at the copy, each view at its own
    offset. Returns the bytes moved. Call before the optimizer is built (it takes views of ``param_data``)."""
    moved = 0
    for buffer in _buffers(ddp):
        old = buffer.param_data
        if old is None:
            continue
        if getattr(buffer, "shared_buffer", None) is not None:
            # MXFP8 parameters (megatron's shared param/grad buffer) are not a K3 configuration: refuse them
            # rather than split one allocation over two regions.
            raise ValueError("--offload-train: this DDP keeps parameters and gradients in one shared buffer (MXFP8 "
                             "parameters); the trainer's memory regions need them apart. Train without MXFP8 "
                             "parameters, or with --no-offload-train")
        with region():
            new = torch.empty_like(old)
        new.copy_(old)
        base = old.storage_offset()

        def view_of(t: torch.Tensor) -> torch.Tensor:
            start = t.storage_offset() - base
            return new[start:start + t.numel()].view(t.shape)

        for bucket in buffer.buckets:
            if bucket.param_data is not None:
                bucket.param_data = view_of(bucket.param_data)
        for param in buffer.params:
            param.data = view_of(param.data)
        buffer.param_data = new
        moved += new.numel() * new.element_size()
    return moved
