"""Load the native MXFP4 checkpoint straight into BF16 tensors, as SGLang does: no converted copy on disk.

The checkpoint is validated exactly as ``k3 convert mxfp4-to-bf16`` validates it (``plan_conversion``: the index,
every shard header, every packed weight's scale), then each tensor is read: a ``X.weight_packed`` +
``X.weight_scale`` pair becomes ``X.weight`` in BF16 through the MXFP4 decoder (the Triton kernel on CUDA, the
codec on the CPU; both bit-identical to the converter's bytes), every other tensor is read as stored. So
``load_native_state_dict(native)`` holds the same tensors, bit for bit, as ``load_state_dict`` of the converted
checkpoint (tested).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from k3.checkpoint.convert import plan_conversion
from k3.checkpoint.hf_io import TEXT_PREFIX, CheckpointError, read_weight_map
from k3.config import K3Config
from k3.kernels.mxfp4.codec import MXFP4Error
from k3.kernels.mxfp4.triton import decode_mxfp4

__all__ = ["is_native_mxfp4", "load_native_state_dict"]

PACKED_SUFFIX = ".weight_packed"


def is_native_mxfp4(weight_names: list[str] | set[str] | dict[str, str]) -> bool:
    """Whether a checkpoint's tensor names (its weight map) hold packed MXFP4 weights."""
    return any(name.endswith(PACKED_SUFFIX) for name in weight_names)


def load_native_state_dict(model_dir: str | Path, device: torch.device | str = "cpu",
                           strip_prefix: str | None = TEXT_PREFIX, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a native MXFP4 checkpoint, packed weights decoded to BF16 on ``device``.

    Names lose ``strip_prefix`` (``language_model.``); names outside it (a vision tower) are left out, as
    ``k3.checkpoint.hf_io.load_state_dict`` does. Decoded weights are ``[out, in]`` BF16; other tensors keep their
    stored dtype. Raises ``CheckpointError`` naming the file and tensor for anything the converter would refuse.
    """
    root = Path(model_dir)
    config = K3Config.from_json(root)
    if config.quantization_config is None:
        packed = sorted(n for n in read_weight_map(root) if n.endswith(PACKED_SUFFIX))
        raise CheckpointError(f"{root}: {len(packed)} tensors are packed MXFP4 (e.g. {packed[:1]}), but config.json "
                              "has no quantization_config: the checkpoint is inconsistent (a BF16 config beside "
                              "native shards?)")
    plan = plan_conversion(root)
    dev = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    ops = [(shard, op) for shard in plan.shards for op in shard.ops]
    with ExitStack() as stack:
        handles: dict[str, object] = {}

        def tensor(file: str, name: str) -> torch.Tensor:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(root / file), framework="pt", device="cpu"))
            try:
                return handles[file].get_tensor(name)
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged data
                raise CheckpointError(f"{root / file}: tensor {name!r} cannot be read ({e})") from e

        for shard, op in tqdm(ops, desc=f"loading {root.name} (MXFP4 decoded on {dev.type})", unit="tensor",
                              disable=None if progress else True):
            name = op.name
            if strip_prefix:
                if not name.startswith(strip_prefix):
                    continue
                name = name[len(strip_prefix):]
            if op.kind == "copy":
                out[name] = tensor(shard.name, op.name).to(dev)
                continue
            base = op.name[: -len(".weight")]
            packed = tensor(shard.name, base + PACKED_SUFFIX)
            scale = tensor(op.scale_file, base + ".weight_scale")
            try:
                out[name] = decode_mxfp4(packed, scale, device=dev)
            except MXFP4Error as e:
                raise CheckpointError(f"{root / shard.name}: tensor {base + PACKED_SUFFIX!r}: {e}") from None
    return out
