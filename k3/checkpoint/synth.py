"""Synthetic K3 checkpoints in the released layout, written as a stream.

``write_synthetic_checkpoint(cfg, out_dir, fmt)`` writes ``config.json`` (the released wrapper, with the real
``quantization_config`` for ``mxfp4``), sharded safetensors and ``model.safetensors.index.json``. Every tensor of
``checkpoint_layout(cfg, fmt)`` is generated in row chunks and streamed into its shard, so memory holds one chunk
(at most ``CHUNK_ELEMENTS`` values), never a shard: the full 2.78T variant only needs the disk.

Values are random with per-family scales that keep the model numerically healthy:

- embedding ~ N(0, 1); linear weights ~ N(0, 1/fan_in); projections writing the residual stream
  (``o_proj``, ``down_proj``, ``routed_expert_up_proj``) ~ N(0, 1/(2 L fan_in)); routed experts ~ N(0, 1/fan_in);
- RMSNorm weights 1, AttnRes pseudo-queries (``*_res_proj``) 0 (the report's init: uniform mixing),
  ``e_score_correction_bias`` 0;
- conv weights ~ U(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d default, fan_in = K for a depthwise conv);
- ``A_log`` = log U(1, 16) on the real heads, zero padding up to ``a_log_stored_len``; ``dt_bias`` =
  softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] floored at 1e-4 (fla's delta-rule init; fla's KDA layer itself
  starts at 0, which would leave the dt_bias path untested).

Routed experts are drawn in BF16 and encoded to MXFP4 with ``encode_mxfp4``; the ``bf16`` format stores the decoded
values, so converting the ``mxfp4`` checkpoint of a seed gives exactly the ``bf16`` checkpoint of the same seed.
Every chunk has its own generator seeded from (seed, tensor name, chunk index): output depends only on the seed
and the config, not on the shard size.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from k3.checkpoint.hf_io import (
    INDEX_NAME,
    SafetensorsStreamWriter,
    check_output_dir,
    commit_output_dir,
)
from k3.checkpoint.layout import TensorSpec, checkpoint_layout
from k3.config import QUANTIZATION_CONFIG_MXFP4, K3Config, variant
from k3.kernels.mxfp4.codec import decode_mxfp4, encode_mxfp4

__all__ = ["CHUNK_ELEMENTS", "plan_shards", "synthetic_config", "synthetic_tensor", "write_synthetic_checkpoint",
           "checkpoint_config"]

CHUNK_ELEMENTS = 1 << 25  # values generated at once (64 MiB of BF16)
_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 1e-1, 1e-4


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Split ``specs`` in order into shards of at most ``max_shard_size`` bytes; a packed weight and its scale
    always share a shard, and a tensor larger than the limit gets a shard of its own."""
    groups: list[list[TensorSpec]] = []
    for s in specs:
        if s.role == "expert_scale" and groups and groups[-1][-1].role == "expert_packed":
            groups[-1].append(s)
        else:
            groups.append([s])
    shards: list[list[TensorSpec]] = []
    size = 0
    for g in groups:
        n = sum(s.nbytes for s in g)
        if shards and size + n <= max_shard_size:
            shards[-1].extend(g)
            size += n
        else:
            shards.append(list(g))
            size = n
    return shards


def checkpoint_config(cfg: K3Config, fmt: str) -> dict:
    """The ``config.json`` of a checkpoint in ``fmt``: the MXFP4 one carries the release's quantization_config."""
    if fmt == "mxfp4":
        qc = cfg.quantization_config if cfg.quantization_config is not None else QUANTIZATION_CONFIG_MXFP4
        return cfg.replace(quantization_config=qc).to_hf_dict()
    return cfg.replace(quantization_config=None).to_hf_dict()


def synthetic_config(name: str, num_experts: int | None = None, num_layers: int | None = None) -> K3Config:
    """The config of ``variant(name)`` with the expert count and/or depth changed (top-k capped at the experts)."""
    cfg = variant(name)
    if num_layers is not None:
        cfg = cfg.replace(num_hidden_layers=num_layers)
    if num_experts is not None:
        cfg = cfg.replace(num_experts=num_experts, num_experts_per_token=min(cfg.num_experts_per_token, num_experts))
    return cfg


def _generator(seed: int, name: str, chunk: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}:{chunk}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _row_chunks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(row_begin, row_end)]`` over dim 0 with at most CHUNK_ELEMENTS values each (fixed, so deterministic)."""
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _values(spec: TensorSpec, cfg: K3Config, rows: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Rows ``rows`` of the logical tensor of ``spec`` (BF16 or F32, as stored; experts in BF16)."""
    shape = (rows[1] - rows[0], *(spec.logical_shape or spec.shape)[1:])
    role = spec.role
    dtype = torch.bfloat16 if role in ("expert_packed", "expert_scale") else spec.dtype
    if role == "norm":
        return torch.ones(shape, dtype=dtype)
    if role in ("res_proj", "router_bias"):
        return torch.zeros(shape, dtype=dtype)
    if role == "embedding":
        return torch.empty(shape, dtype=dtype).normal_(0.0, 1.0, generator=g)
    if role in ("linear", "router"):
        return torch.empty(shape, dtype=dtype).normal_(0.0, spec.fan_in**-0.5, generator=g)
    if role in ("linear_out", "expert", "expert_packed"):
        std = (2 * cfg.num_hidden_layers * spec.fan_in) ** -0.5 if role == "linear_out" else spec.fan_in**-0.5
        return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=g)
    if role == "conv":
        bound = cfg.linear_attn_config.short_conv_kernel_size**-0.5
        return torch.empty(shape, dtype=dtype).uniform_(-bound, bound, generator=g)
    if role == "a_log":
        out = torch.zeros(shape, dtype=dtype)
        n = max(0, min(rows[1], cfg.num_kda_heads) - rows[0])
        out[:n] = torch.empty(n, dtype=torch.float32).uniform_(1.0, 16.0, generator=g).log()
        return out
    if role == "dt_bias":
        u = torch.rand(shape, dtype=torch.float64, generator=g)
        dt = torch.exp(u * (math.log(_DT_MAX) - math.log(_DT_MIN)) + math.log(_DT_MIN)).clamp(min=_DT_FLOOR)
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)  # inverse softplus
    raise ValueError(f"{spec.name}: no synthetic init for role {role!r}")


def synthetic_tensor(
    spec: TensorSpec, cfg: K3Config, seed: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(row_begin, stored chunk, scale chunk or None)`` for ``spec``.

    A packed spec yields ``(rows, weight_packed rows, weight_scale rows)``; a BF16 expert yields its MXFP4-decoded
    values, so both formats of one seed hold the same expert weights.
    """
    for i, rows in enumerate(_row_chunks(spec.logical_shape or spec.shape)):
        v = _values(spec, cfg, rows, _generator(seed, spec.weight_name, i))
        if spec.role == "expert_packed":
            packed, scale = encode_mxfp4(v)
            yield rows[0], packed, scale
        elif spec.role == "expert":
            yield rows[0], decode_mxfp4(*encode_mxfp4(v)), None
        else:
            yield rows[0], v, None


def write_synthetic_checkpoint(
    cfg: K3Config,
    out_dir: str | Path,
    fmt: str = "mxfp4",
    seed: int = 0,
    max_shard_size: int = 2_000_000_000,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write a synthetic checkpoint of ``cfg`` in ``fmt`` (``mxfp4`` | ``bf16``) to ``out_dir``; returns the path.

    Built in ``.<name>.k3-synth-partial`` beside ``out_dir`` and renamed at the end. Raises CheckpointError if
    ``out_dir`` is non-empty and ``overwrite`` is off.
    """
    out = Path(out_dir)
    check_output_dir(out, overwrite)
    specs = checkpoint_layout(cfg, fmt)
    shards = plan_shards(specs, max_shard_size)
    staging = out.parent / f".{out.name}.k3-synth-partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    total = sum(s.nbytes for s in specs)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {fmt}", disable=not progress)
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        # Widest dtypes first (stable), as safetensors does, so every tensor stays aligned to its item size.
        ordered = sorted(shard, key=lambda s: -torch.empty((), dtype=s.dtype).element_size())
        with SafetensorsStreamWriter(
            staging / name, [(s.name, s.safetensors_dtype, s.shape) for s in ordered], {"format": "pt"}, checksum=False
        ) as w:
            pending_scale: list[torch.Tensor] = []
            for s in ordered:
                weight_map[s.name] = name
                if s.role == "expert_scale":  # produced with its packed weight, written right after it
                    w.write(s.name, torch.cat(pending_scale) if len(pending_scale) > 1 else pending_scale[0])
                    bar.update(s.nbytes)
                    pending_scale = []
                    continue
                for _, chunk, scale in synthetic_tensor(s, cfg, seed):
                    w.write(s.name, chunk)
                    bar.update(chunk.numel() * chunk.element_size())
                    if scale is not None:
                        pending_scale.append(scale)
            w.close()
    bar.close()

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (staging / "config.json").write_text(json.dumps(checkpoint_config(cfg, fmt), indent=2) + "\n")
    commit_output_dir(staging, out, overwrite)
    return out
