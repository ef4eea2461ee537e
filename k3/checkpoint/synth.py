"""Synthetic K3 checkpoints in the released layout, written in parallel from a device-independent random stream.

``write_synthetic_checkpoint(cfg, out_dir, fmt)`` writes ``config.json`` (the released wrapper, with the real
``quantization_config`` for ``mxfp4``), sharded safetensors and ``model.safetensors.index.json``. The bytes are a
function of (seed, config, format, shard size) alone: the same for any ``workers`` and any ``device``.

**The random stream.** Every tensor has its own stream, keyed by ``stream_key(seed, weight name)``. Draw ``i`` of
a stream is 16 bits of a counter-based hash: word ``j = i // 4`` is splitmix64's finaliser of ``key + j * golden``
(64-bit wrap-around), and draw ``i`` is its 16-bit piece ``i % 4`` (little-endian) XOR ``0x8000``, in
``[0, 65536)``. Only integer arithmetic, so torch computes it bit for bit alike on the CPU and on CUDA, for any
chunking of the tensor (``draws``).

**Values.** Each draw picks one entry of a 65,536-entry table of its tensor's distribution, evaluated at the
quantiles ``(k + 0.5) / 65536`` (float64 on the CPU, then rounded to the stored dtype once). So a value is a
table gather, exact on every device. The distributions, per family:

- embedding ~ N(0, 1); linear weights ~ N(0, 1/fan_in); projections writing the residual stream
  (``o_proj``, ``down_proj``, ``routed_expert_up_proj``) ~ N(0, 1/(2 L fan_in)); routed experts ~ N(0, 1/fan_in)
  (normal quantiles, so clipped at +-4.33 standard deviations);
- RMSNorm weights 1, AttnRes pseudo-queries (``*_res_proj``) 0 (the report's init: uniform mixing),
  ``e_score_correction_bias`` 0;
- conv weights ~ U(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d default, fan_in = K for a depthwise conv);
- ``A_log`` = log U(1, 16) on the real heads, zero padding up to ``a_log_stored_len``; ``dt_bias`` =
  softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] floored at 1e-4 (fla's delta-rule init; fla's KDA layer itself
  starts at 0, which would leave the dt_bias path untested).

**Routed experts** are the MXFP4 encoding (``encode_mxfp4``, OCP MX v1.0) of their BF16 normal values. Encoding a
block of 32 only needs each value's exponent and the block's largest exponent, so ``_ExpertCodebook`` tabulates,
from the codec itself, every value's E2M1 code and decoded BF16 value under every block exponent: an expert chunk is
gathers and one max over each block, bit-identical to ``encode_mxfp4`` of the values (tested). The ``bf16`` format
stores the decoded values, so converting the ``mxfp4`` checkpoint of a seed gives exactly the ``bf16`` checkpoint
of the same seed.

**Writing.** Every shard file is created at its final size with its header (the same header, tensor order and
offsets as a streamed safetensors file); the tensors are cut into row ranges and grouped into tasks of about
``TASK_ELEMENTS`` values, which ``workers`` spawned processes (or this process, for 1) take in turn, generate on
``device`` in chunks of ``CHUNK_ELEMENTS`` (CUDA: ``CUDA_CHUNK_ELEMENTS``) and write with ``pwrite`` at their
offsets. Memory per process: one chunk and its index arrays (~18 bytes a value), never a shard. Everything is
built in ``.<name>.k3-synth-partial`` beside ``out_dir``, fsynced, and renamed into place at the end: a killed
writer leaves only that hidden folder (its workers die with it), never an ``out_dir`` that looks complete.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from k3.checkpoint.hf_io import (
    INDEX_NAME,
    CheckpointError,
    check_output_dir,
    commit_output_dir,
    fsync_dir,
    safetensors_header,
)
from k3.checkpoint.layout import TensorSpec, checkpoint_layout
from k3.config import QUANTIZATION_CONFIG_MXFP4, K3Config, variant
from k3.kernels.mxfp4.codec import BLOCK_SIZE, decode_mxfp4, encode_mxfp4

__all__ = [
    "CHUNK_ELEMENTS",
    "CUDA_CHUNK_ELEMENTS",
    "DEVICES",
    "TABLE_SIZE",
    "checkpoint_config",
    "default_workers",
    "draws",
    "phases_text",
    "plan_shards",
    "stream_key",
    "synthetic_config",
    "synthetic_tensor",
    "write_synthetic_checkpoint",
]

# Values generated at once. On the CPU the working set (~18 bytes a value: draws, indices, output) stays in L2:
# 1.5x the throughput of 4M-value chunks (measured). On a GPU, large enough that launches do not set the pace.
CHUNK_ELEMENTS = 1 << 18
CUDA_CHUNK_ELEMENTS = 1 << 23
TASK_ELEMENTS = 1 << 22  # values per task handed to a worker on the CPU (on CUDA: one CUDA chunk)
DEVICES = ("cpu", "cuda")
TABLE_SIZE = 1 << 16  # entries of a distribution table: one per 16-bit draw
MAX_AUTO_WORKERS = 16
BYTES_PER_AUTO_WORKER = 256 << 20  # a spawned worker costs ~2 s of start-up: worth it from about this much output
_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 1e-1, 1e-4
_SHARD_METADATA = {"format": "pt"}


# ------------------------------------------------------------------------------------------------ shards, config
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


# ------------------------------------------------------------------------------------------------ the stream
def _int64(x: int) -> int:
    """The signed 64-bit integer with the bits of ``x mod 2^64`` (torch has no unsigned 64-bit arithmetic)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _int64(0x9E3779B97F4A7C15)  # splitmix64's increment and finaliser constants
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_DRAWS_PER_WORD = 4


def stream_key(seed: int, name: str) -> int:
    """The stream key of tensor ``name`` (its BF16 weight name) under ``seed``: 64 bits of sha256, signed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def draws(key: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Draws ``start .. start + count - 1`` of stream ``key``: int32 ``[count]`` in ``[0, TABLE_SIZE)``.

    Bit-identical on every device and for every split of a range into calls (see the module docstring).
    """
    first, end = start // _DRAWS_PER_WORD, -(-(start + count) // _DRAWS_PER_WORD)
    counters = _counters(end - first, str(torch.device(device)))
    z = torch.add(counters[: end - first], first).mul_(_GOLDEN).add_(key)
    t = torch.empty_like(z)
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):
        # z ^= z >>> shift: torch's >> is arithmetic on int64, so mask the sign copies off.
        torch.bitwise_right_shift(z, shift, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(mult)
    skip = start - first * _DRAWS_PER_WORD
    # An int16 piece s read as signed is (u - 65536 * [u >= 32768]); s + 32768 is u XOR 0x8000.
    return z.view(torch.int16)[skip : skip + count].to(torch.int32).add_(1 << 15)


@functools.lru_cache(maxsize=4)
def _counters_cached(n: int, device: str) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


def _counters(n: int, device: str) -> torch.Tensor:
    """``arange(>= n)`` int64 on ``device``, kept: an offset copy of it is ~3x cheaper than a fresh arange."""
    return _counters_cached(max(n, _chunk_elements(device) // _DRAWS_PER_WORD + 1), device)


def _chunk_elements(device: str) -> int:
    return CHUNK_ELEMENTS if torch.device(device).type == "cpu" else CUDA_CHUNK_ELEMENTS


# ------------------------------------------------------------------------------------------------ value tables
def _quantiles() -> torch.Tensor:
    return (torch.arange(TABLE_SIZE, dtype=torch.float64) + 0.5) / TABLE_SIZE


@functools.lru_cache(maxsize=64)
def _table(kind: str, scale: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[TABLE_SIZE]`` values of distribution ``kind`` at the quantiles, in ``dtype`` on ``device``.

    ``normal``: N(0, scale^2); ``uniform``: U(-scale, scale); ``a_log``: log U(1, 16); ``dt_bias``: the inverse
    softplus of dt log-uniform in [_DT_MIN, _DT_MAX] (``scale`` unused by the last two). Computed in float64 on the
    CPU and rounded once, so every device gathers the same values.
    """
    q = _quantiles()
    if kind == "normal":
        v = torch.special.ndtri(q) * scale
    elif kind == "uniform":
        v = (2 * q - 1) * scale
    elif kind == "a_log":
        v = torch.log(1 + 15 * q)
    elif kind == "dt_bias":
        dt = torch.exp(q * (math.log(_DT_MAX) - math.log(_DT_MIN)) + math.log(_DT_MIN)).clamp(min=_DT_FLOOR)
        v = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    else:
        raise ValueError(f"no synthetic distribution {kind!r}")
    return v.to(dtype).to(device)


@dataclass(frozen=True)
class _ExpertCodebook:
    """The MXFP4 encoding of the BF16 table ``N(0, std^2)`` under every block exponent that can occur.

    ``exponent[k]`` is ``floor(log2 |value_k|)``; a block's level is its largest exponent minus ``lowest``.
    ``codes[level * TABLE_SIZE + k]`` is value k's E2M1 code (sign included) in a block of that level,
    ``decoded[...]`` its decoded BF16 value, ``scales[level]`` the block's E8M0 scale byte.
    """

    exponent: torch.Tensor  # int32 [TABLE_SIZE]
    lowest: int
    codes: torch.Tensor  # uint8 [levels * TABLE_SIZE]
    decoded: torch.Tensor  # bfloat16 [levels * TABLE_SIZE]
    scales: torch.Tensor  # uint8 [levels]

    def to(self, device: str) -> "_ExpertCodebook":
        return _ExpertCodebook(self.exponent.to(device), self.lowest, self.codes.to(device),
                               self.decoded.to(device), self.scales.to(device))


@functools.lru_cache(maxsize=16)
def _expert_codebook(std: float, device: str) -> _ExpertCodebook:
    if device != "cpu":
        return _expert_codebook(std, "cpu").to(device)
    values = _table("normal", std, torch.bfloat16, "cpu").float()
    if not bool((values != 0).all()):  # a zero has no exponent; the normal quantiles never round to 0
        raise AssertionError("expert table holds a zero")
    exponent = (torch.frexp(values.abs()).exponent - 1).to(torch.int32)
    lowest, highest = int(exponent.min()), int(exponent.max())
    levels = highest - lowest + 1
    codes = torch.zeros(levels, TABLE_SIZE, dtype=torch.uint8)
    scales = torch.empty(levels, dtype=torch.uint8)
    per_block = BLOCK_SIZE - 1
    blocks = -(-TABLE_SIZE // per_block)
    for level in range(levels):
        # Blocks of [2^e, 31 table values]: a block's largest exponent is then e, as long as it holds only values of
        # exponent <= e, the only ones a real block at this level can hold; the others are zeroed (codes unused).
        e = lowest + level
        members = torch.zeros(blocks * per_block, dtype=torch.float32)
        members[:TABLE_SIZE] = torch.where(exponent <= e, values, 0.0)
        x = torch.cat([torch.full((blocks, 1), 2.0**e), members.view(blocks, per_block)], dim=1)
        packed, scale = encode_mxfp4(x)
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(blocks, BLOCK_SIZE)
        codes[level] = nibbles[:, 1:].reshape(-1)[:TABLE_SIZE]
        scales[level] = scale[0, 0]
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
    decoded = decode_mxfp4(pairs, scales[:, None].expand(levels, TABLE_SIZE // BLOCK_SIZE).contiguous())
    return _ExpertCodebook(exponent, lowest, codes.view(-1), decoded.reshape(-1).contiguous(), scales)


# ------------------------------------------------------------------------------------------------ chunks
def _logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    return spec.logical_shape or spec.shape


def _row_elements(spec: TensorSpec) -> int:
    shape = _logical_shape(spec)
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(table, 0, index.reshape(-1)).view(index.shape)


def _values(spec: TensorSpec, cfg: K3Config, seed: int, rows: tuple[int, int], device: str) -> torch.Tensor:
    """Rows ``rows`` of a non-expert tensor, in its stored dtype, on ``device``."""
    shape = (rows[1] - rows[0], *_logical_shape(spec)[1:])
    role, dtype = spec.role, spec.dtype
    if role == "norm":
        return torch.ones(shape, dtype=dtype, device=device)
    if role in ("res_proj", "router_bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    if role == "embedding":
        kind, scale = "normal", 1.0
    elif role in ("linear", "router"):
        kind, scale = "normal", spec.fan_in**-0.5
    elif role == "linear_out":
        kind, scale = "normal", (2 * cfg.num_hidden_layers * spec.fan_in) ** -0.5
    elif role == "conv":
        kind, scale = "uniform", cfg.linear_attn_config.short_conv_kernel_size**-0.5
    elif role in ("a_log", "dt_bias"):
        kind, scale = role, 0.0
    else:
        raise ValueError(f"{spec.name}: no synthetic init for role {role!r}")
    start, count = rows[0] * _row_elements(spec), math.prod(shape)
    d = draws(stream_key(seed, spec.weight_name), start, count, device)
    out = _gather(_table(kind, scale, dtype, str(torch.device(device).type)), d).view(shape)
    if role == "a_log":  # heads past the real ones are padding, stored as 0
        first_pad = max(0, cfg.num_kda_heads - start)
        out.view(-1)[first_pad:] = 0
    return out


def _expert(spec: TensorSpec, seed: int, rows: tuple[int, int], device: str
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``rows`` of a routed expert: ``(packed, scale)`` uint8 for ``expert_packed``, ``(bf16, None)`` for
    ``expert``; identical to ``encode_mxfp4`` of the BF16 normal values (and its decode)."""
    out_features, in_features = _logical_shape(spec)
    n_rows = rows[1] - rows[0]
    book = _expert_codebook(spec.fan_in**-0.5, str(torch.device(device).type))
    d = draws(stream_key(seed, spec.weight_name), rows[0] * in_features, n_rows * in_features, device)
    d = d.view(n_rows, in_features)
    pad = -in_features % BLOCK_SIZE
    if pad:  # a short last block: padding draws never raise the block exponent and are cut off below
        d = torch.nn.functional.pad(d, (0, pad), value=int(book.exponent.argmin()))
    blocks = d.view(n_rows, -1, BLOCK_SIZE)
    level = _gather(book.exponent, blocks).amax(-1).sub_(book.lowest)  # [rows, blocks]
    scale = _gather(book.scales, level) if spec.role == "expert_packed" else None
    # In place: a fresh multi-MB tensor costs its page faults, more than the add itself.
    index = blocks.add_(level.mul_(TABLE_SIZE).unsqueeze(-1)).view(n_rows, -1)[:, :in_features]
    if scale is None:
        return _gather(book.decoded, index), None
    codes = _gather(book.codes, index)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def _chunk(spec: TensorSpec, cfg: K3Config, seed: int, rows: tuple[int, int], device: str
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if spec.role in ("expert", "expert_packed"):
        return _expert(spec, seed, rows, device)
    return _values(spec, cfg, seed, rows, device), None


def _row_chunks(spec: TensorSpec, max_elements: int, rows: tuple[int, int] | None = None
                ) -> list[tuple[int, int]]:
    """``[(row_begin, row_end)]`` covering ``rows`` (default: all of dim 0) with at most ``max_elements`` values
    each, at least one row."""
    shape = _logical_shape(spec)
    first, end = rows if rows is not None else (0, shape[0] if shape else 1)
    step = max(1, max_elements // max(_row_elements(spec), 1))
    return [(r, min(r + step, end)) for r in range(first, end, step)]


def synthetic_tensor(
    spec: TensorSpec, cfg: K3Config, seed: int, device: str = "cpu"
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(row_begin, stored chunk, scale chunk or None)`` for ``spec``, generated on ``device``.

    A packed spec yields ``(rows, weight_packed rows, weight_scale rows)``; a BF16 expert yields its MXFP4-decoded
    values, so both formats of one seed hold the same expert weights. An ``expert_scale`` spec yields nothing: its
    rows come with its packed weight.
    """
    if spec.role == "expert_scale":
        return
    for rows in _row_chunks(spec, _chunk_elements(device)):
        stored, scale = _chunk(spec, cfg, seed, rows, device)
        yield rows[0], stored, scale


# ------------------------------------------------------------------------------------------------ the file plan
@dataclass(frozen=True)
class _Plan:
    """Where every stored tensor's bytes go: ``place[name] = (shard file name, byte offset of its data)``."""

    cfg: K3Config
    seed: int
    specs: tuple[TensorSpec, ...]
    place: dict[str, tuple[str, int]]
    files: dict[str, tuple[bytes, int]]  # shard file name -> (header bytes, file size)


def _file_plan(cfg: K3Config, fmt: str, seed: int, max_shard_size: int) -> _Plan:
    specs = checkpoint_layout(cfg, fmt)
    shards = plan_shards(specs, max_shard_size)
    place: dict[str, tuple[str, int]] = {}
    files: dict[str, tuple[bytes, int]] = {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        # Widest dtypes first (stable), as safetensors does, so every tensor stays aligned to its item size.
        ordered = sorted(shard, key=lambda s: -torch.empty((), dtype=s.dtype).element_size())
        header, sizes = safetensors_header([(s.name, s.safetensors_dtype, s.shape) for s in ordered],
                                           _SHARD_METADATA)
        offset = len(header)
        for s, (_, nbytes) in zip(ordered, sizes):
            place[s.name] = (name, offset)
            offset += nbytes
        files[name] = (header, offset)
    return _Plan(cfg, seed, tuple(specs), place, files)


def _tasks(plan: _Plan, workers: int, device: str) -> list[list[tuple[int, int, int]]]:
    """Pieces ``(spec index, row_begin, row_end)`` grouped into tasks of about ``min(TASK_ELEMENTS (CUDA:
    CUDA_CHUNK_ELEMENTS), all / (4 workers))`` values: big tensors are split, small ones batched, and every worker
    gets several tasks."""
    total = sum(math.prod(_logical_shape(s)) for s in plan.specs if s.role != "expert_scale")
    largest = TASK_ELEMENTS if torch.device(device).type == "cpu" else CUDA_CHUNK_ELEMENTS
    target = max(1, min(largest, -(-total // (4 * workers))))
    tasks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    size = 0
    for i, s in enumerate(plan.specs):
        if s.role == "expert_scale":
            continue  # written with its packed weight
        per_row = _row_elements(s)
        for r0, r1 in _row_chunks(s, target):
            n = (r1 - r0) * per_row
            if current and size + n > target:
                tasks.append(current)
                current, size = [], 0
            current.append((i, r0, r1))
            size += n
    if current:
        tasks.append(current)
    return tasks


# ------------------------------------------------------------------------------------------------ one task
def _pwrite(fd: int, data: torch.Tensor, offset: int) -> int:
    view = memoryview(data.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):  # pwrite may write less than asked
        done += os.pwrite(fd, view[done:], offset + done)
    return done


class _TaskWriter:
    """Generates tasks of ``plan`` on ``device`` into the shard files in ``root`` (one open fd per file)."""

    def __init__(self, plan: _Plan, root: Path, device: str) -> None:
        self.plan, self.root, self.device = plan, root, device
        self.by_name = {s.name: s for s in plan.specs}
        self._fds: dict[str, int] = {}

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(self.root / file, os.O_WRONLY)
        return self._fds[file]

    def run(self, task: list[tuple[int, int, int]]) -> int:
        """Write every piece of ``task``; returns the bytes written."""
        written = 0
        for i, r0, r1 in task:
            spec = self.plan.specs[i]
            for rows in _row_chunks(spec, _chunk_elements(self.device), (r0, r1)):
                stored, scale = _chunk(spec, self.plan.cfg, self.plan.seed, rows, self.device)
                file, begin = self.plan.place[spec.name]
                row_bytes = stored[0].numel() * stored.element_size()
                written += _pwrite(self._fd(file), stored, begin + rows[0] * row_bytes)
                if scale is not None:
                    scale_spec = self.by_name[spec.name[: -len("_packed")] + "_scale"]
                    file, begin = self.plan.place[scale_spec.name]
                    written += _pwrite(self._fd(file), scale, begin + rows[0] * scale.shape[1])
        return written

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# Pool workers keep one _TaskWriter each, made by the initializer.
_worker_writer: _TaskWriter | None = None


def _die_with_parent() -> None:
    # A killed writer must not leave workers writing into the staging folder.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_init(plan: _Plan, root: str, device: str) -> None:
    global _worker_writer
    _die_with_parent()
    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism
    _worker_writer = _TaskWriter(plan, Path(root), device)


def _worker_run(task: list[tuple[int, int, int]]) -> int:
    assert _worker_writer is not None
    return _worker_writer.run(task)


# ------------------------------------------------------------------------------------------------ the writer
def default_workers(total_bytes: int) -> int:
    """Processes for a checkpoint of ``total_bytes``: one per available CPU, at most MAX_AUTO_WORKERS, and no more
    than one per BYTES_PER_AUTO_WORKER of output (a small checkpoint is written in this process)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_AUTO_WORKERS, -(-total_bytes // BYTES_PER_AUTO_WORKER)))


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise CheckpointError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                              "use --device cpu")


def write_synthetic_checkpoint(
    cfg: K3Config,
    out_dir: str | Path,
    fmt: str = "mxfp4",
    seed: int = 0,
    max_shard_size: int = 2_000_000_000,
    overwrite: bool = False,
    progress: bool = True,
    workers: int | None = None,
    device: str = "cpu",
    timings: dict[str, float] | None = None,
) -> Path:
    """Write a synthetic checkpoint of ``cfg`` in ``fmt`` (``mxfp4`` | ``bf16``) to ``out_dir``; returns the path.

    ``workers`` processes generate and write it (None: ``default_workers``; 1: this process), on ``device``
    (``cpu`` | ``cuda``); the bytes do not depend on either. Built in ``.<name>.k3-synth-partial`` beside
    ``out_dir`` and renamed at the end. ``timings``, when given, receives where the time went (seconds):
    ``files_s`` (the shard files created at their size), ``write_s`` (workers started, every value generated
    and written into the page cache), ``fsync_s`` (the flush to disk, index and config included), and ``bytes``
    (of the shard files).
    Raises CheckpointError if ``out_dir`` is non-empty and ``overwrite`` is off, for ``workers`` < 1, and for an
    unknown device or ``cuda`` without one.
    """
    if workers is not None and workers < 1:
        raise CheckpointError(f"--workers {workers}: expected at least 1")
    _check_device(device)
    out = Path(out_dir)
    check_output_dir(out, overwrite)
    plan = _file_plan(cfg, fmt, seed, max_shard_size)
    total = sum(s.nbytes for s in plan.specs)
    if workers is None:
        workers = default_workers(total)
    tasks = _tasks(plan, workers, device)
    workers = min(workers, len(tasks))

    staging = out.parent / f".{out.name}.k3-synth-partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    clock = [time.perf_counter()]
    try:
        for file, (header, size) in plan.files.items():
            with open(staging / file, "wb") as f:
                f.write(header)
                f.truncate(size)
        clock.append(time.perf_counter())
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {fmt}", disable=not progress) as bar:
            if workers == 1:
                writer = _TaskWriter(plan, staging, device)
                # One thread, as in a pool worker: chunks are cache-sized, and on a busy machine torch's intra-op
                # threads spin-wait for each other (measured on 2 shared cores: ~10x the CPU time for the same bytes).
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    for task in tasks:
                        bar.update(writer.run(task))
                finally:
                    torch.set_num_threads(threads)
                    writer.close()
            else:
                ctx = mp.get_context("spawn")  # forking a process with threads (tqdm, torch, CUDA) is unsafe
                with ctx.Pool(workers, initializer=_worker_init, initargs=(plan, str(staging), device)) as pool:
                    for n in pool.imap_unordered(_worker_run, tasks):
                        bar.update(n)
        clock.append(time.perf_counter())
        with ThreadPoolExecutor(max_workers=min(8, len(plan.files))) as ex:  # fsyncs of separate files overlap
            list(ex.map(lambda file: _fsync(staging / file), plan.files))
        weight_map = {name: file for name, (file, _) in plan.place.items()}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (staging / "config.json").write_text(json.dumps(checkpoint_config(cfg, fmt), indent=2) + "\n")
        fsync_dir(staging)
        clock.append(time.perf_counter())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    commit_output_dir(staging, out, overwrite)
    if timings is not None:
        files_s, write_s, fsync_s = (b - a for a, b in zip(clock, clock[1:]))
        shard_bytes = sum(size for _, size in plan.files.values())  # headers included, as on disk
        timings.update(files_s=files_s, write_s=write_s, fsync_s=fsync_s, bytes=float(shard_bytes))
    return out


def phases_text(timings: dict[str, float]) -> str:
    """``write_synthetic_checkpoint``'s ``timings`` as one line: "12.00 GB: files 0.1 s, generate + write 10.2 s
    (1.18 GB/s), fsync 4.4 s" (GB = 10^9 bytes). ``bench/synth_checkpoint.py`` reads it back."""
    gb = timings["bytes"] / 1e9
    rate = gb / timings["write_s"] if timings["write_s"] > 0 else float("inf")
    return (f"{gb:.2f} GB: files {timings['files_s']:.1f} s, generate + write {timings['write_s']:.1f} s "
            f"({rate:.2f} GB/s), fsync {timings['fsync_s']:.1f} s")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
