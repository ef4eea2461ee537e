"""What an HF checkpoint directory holds, from its ``config.json``, its index and its shard headers alone (no tensor
data): the K3 config, whether the config declares the native MXFP4 quantization, every text tensor's stored shape,
and where the stored tensors disagree with the layout the config implies (``k3.checkpoint.layout``).

``k3 train --dry-run`` reads this to say, before anything starts, whether ``--hf-checkpoint`` is the native MXFP4
release or a BF16 conversion and whether it is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3.checkpoint.hf_io import (TEXT_PREFIX, CheckpointError, read_config_json, read_safetensors_header,
                                 read_weight_map)
from k3.checkpoint.layout import checkpoint_layout
from k3.config import ConfigError, K3Config

__all__ = ["HFInventory", "read_hf_inventory", "layout_mismatches", "PACKED_SUFFIX"]

PACKED_SUFFIX = ".weight_packed"


@dataclass(frozen=True)
class HFInventory:
    """An HF checkpoint directory: ``config`` (from ``config.json``), ``declared_mxfp4`` (the config carries a
    ``quantization_config``), ``quantization_format`` (its ``format``, None without one) and ``shapes``: every
    stored tensor under ``language_model.`` -> its shape, from the shard headers."""

    directory: Path
    config: K3Config
    declared_mxfp4: bool
    quantization_format: str | None
    shapes: dict[str, tuple[int, ...]]

    @property
    def packed(self) -> list[str]:
        """The stored MXFP4-packed weights (``…weight_packed``), in name order."""
        return sorted(n for n in self.shapes if n.endswith(PACKED_SUFFIX))

    @property
    def stored_format(self) -> str:
        """``mxfp4`` when packed weights are stored, else ``bf16``: what the tensors are, whatever the config says."""
        return "mxfp4" if self.packed else "bf16"


def read_hf_inventory(model_dir: str | Path) -> HFInventory:
    """Read ``model_dir``'s config, index and shard headers. Raises ``CheckpointError`` naming the file: not a
    directory, no or unreadable ``config.json``, a config K3 cannot run (the field and what it expects), no index
    and no ``model.safetensors``, an index naming missing shards, a corrupt shard header."""
    root = Path(model_dir)
    path, raw = read_config_json(root)
    try:
        config = K3Config.from_dict(raw)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path} is not a K3 config: {e}") from None
    qc = config.quantization_config
    weight_map = read_weight_map(root)
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(set(weight_map.values())):
        for name, entry in read_safetensors_header(root / shard).entries.items():
            if name.startswith(TEXT_PREFIX):
                shapes[name] = entry.shape
    return HFInventory(root, config, qc is not None, qc.get("format") if isinstance(qc, dict) else None, shapes)


def layout_mismatches(inventory: HFInventory) -> list[str]:
    """Where the stored tensors disagree with the layout of the checkpoint's own config in its stored format: one
    line per missing tensor or tensor of another shape, e.g. ``language_model.lm_head.weight: shape [512, 64] in
    the shards, [512, 32] by config.json`` (empty: every tensor the config implies is there, in its shape)."""
    out: list[str] = []
    for spec in checkpoint_layout(inventory.config, inventory.stored_format):
        stored = inventory.shapes.get(spec.name)
        if stored is None:
            out.append(f"{spec.name}: missing (config.json implies {list(spec.shape)})")
        elif tuple(stored) != tuple(spec.shape):
            out.append(f"{spec.name}: shape {list(stored)} in the shards, {list(spec.shape)} by config.json")
    return out
