"""Stand-in for ``sglang.srt.weight_sync.tensor_bucket`` (same metadata fields; reconstruction written here)."""

from dataclasses import dataclass

import torch


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def reconstruct(flattened_tensor: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket: byte ranges of a flat uint8 tensor, as SGLang's worker reads it."""
    if flattened_tensor.dtype != torch.uint8 or flattened_tensor.dim() != 1:
        raise TypeError(f"flattened bucket: expected a 1-D uint8 tensor, got {flattened_tensor.dtype}")
    out = []
    for m in metadata:
        raw = flattened_tensor[m.start_idx:m.end_idx]
        if raw.numel() != m.numel or m.numel != m.dtype.itemsize * torch.Size(m.shape).numel():
            raise ValueError(f"flattened bucket: {m.name} has {raw.numel()} bytes, its metadata says {m.numel}")
        out.append((m.name, raw.view(m.dtype).reshape(m.shape)))
    return out
