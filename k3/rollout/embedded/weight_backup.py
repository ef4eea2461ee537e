"""The embedded engine's host copy of its weights while ``weights`` is released (``lora_base_cpu_backup``).

A CUDA engine keeps one page-locked (pinned) host buffer per parameter, made at the first release and reused by every
later one: a release copies each parameter into its buffer and drops the device copy; a resume copies it back. Pinned
memory is what makes the copies run at the link's speed: the first smoke-gpu run on an H100 (2026-12-05) moved the
4layer slice's 11.2 GB through pageable ``.to("cpu")`` copies in 8.4–9.7 s per release, a pinned copy runs at tens of
GB/s. The cost is host memory: the buffers stay allocated while the weights are on the device too (the engine's
weight bytes, once), instead of existing only while released. The copies are queued on the current stream and
waited for once, at the end of each move.

A CPU engine has nothing to move: its "backup" is the parameter's own storage, and ``.data`` is swapped for an empty
tensor so that a released engine really holds no weights.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WeightBackup"]


class WeightBackup:
    """Host copies of ``model``'s parameters (module docstring): :meth:`save` empties the device copies,
    :meth:`restore` puts them back on ``device``, bit for bit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: dict[str, torch.Tensor] = {}  # pinned buffers (CUDA), kept between releases
        self._held: dict[str, torch.Tensor] = {}  # the storage of each parameter while released
        self.saved = False

    def host_bytes(self) -> int:
        """Bytes of host memory the backup holds now (pinned buffers, or a CPU engine's released parameters)."""
        tensors = self._host if self.device.type == "cuda" else self._held
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def save(self, model: nn.Module) -> None:
        """Copy every parameter to the host and leave each ``.data`` an empty tensor on its device."""
        if self.saved:
            raise RuntimeError("WeightBackup.save: the weights are already saved; restore them first")
        for name, p in model.named_parameters():
            if p.device.type == "cuda":
                host = self._host.get(name)
                if host is None or host.shape != p.shape or host.dtype != p.dtype:
                    host = self._host[name] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p.data, non_blocking=True)
                self._held[name] = host
            else:
                self._held[name] = p.data
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the device copies are dropped below: the bytes must be home first
        for p in model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.saved = True

    def restore(self, model: nn.Module) -> None:
        """Put every saved parameter back on ``device`` (the pinned buffers stay for the next release)."""
        if not self.saved:
            raise RuntimeError("WeightBackup.restore: nothing was saved")
        missing = [n for n, _ in model.named_parameters() if n not in self._held]
        if missing:
            raise RuntimeError(f"WeightBackup.restore: no host copy of {missing[:3]} ({len(missing)} parameters)")
        for name, p in model.named_parameters():
            p.data = self._held.pop(name).to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the next save writes into the same pinned buffers
        self.saved = False

    def clear(self) -> None:
        """Drop every host copy (the engine is shutting down)."""
        self._host.clear()
        self._held.clear()
        self.saved = False
