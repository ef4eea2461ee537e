"""Applying a complete adapter version to an engine's model, all or nothing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from k3.lora.export import ExportError, load_adapter_tensors
from k3.rollout.errors import AdapterVersionError


class AdapterLoader:
    """Load PEFT-named adapter tensors into ``model``'s LoRA factors (``k3.lora.export.load_adapter_tensors``).

    A version is applied only when it is newer than the active one, its chunks run ``is_first`` … ``is_last``
    with one version number, and it names every adapter tensor of the model exactly once; otherwise
    ``AdapterVersionError`` and the model keeps the previous version untouched.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def load(self, chunks: Iterable[Any], version: int, current: int) -> None:
        if version <= current:
            raise AdapterVersionError(f"adapter version {version} is not newer than the active version {current}")
        named: list[tuple[str, torch.Tensor]] = []
        chunks = list(chunks)
        if not chunks:
            raise AdapterVersionError(f"adapter version {version}: no chunks")
        if not chunks[0].is_first or not chunks[-1].is_last:
            raise AdapterVersionError(f"adapter version {version}: the chunk stream is not first…last complete")
        for i, c in enumerate(chunks):
            if c.version != version:
                raise AdapterVersionError(f"chunk {i} carries version {c.version}, expected {version}")
            if (i > 0 and c.is_first) or (i < len(chunks) - 1 and c.is_last):
                raise AdapterVersionError(f"adapter version {version}: chunk {i} is marked first/last out of place")
            named.extend(c.tensors)
        self.load_tensors(named)

    def load_tensors(self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> list[str]:
        """Every adapter tensor of the model, by PEFT name (strict), validated before anything is copied."""
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        try:
            return load_adapter_tensors(self.model, items, strict=True)
        except ExportError as e:
            raise AdapterVersionError(str(e)) from e
