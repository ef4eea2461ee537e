"""``k3 convert mxfp4-to-bf16``: the native MXFP4 checkpoint to BF16, shard by shard.

Every ``X.weight_packed`` + ``X.weight_scale`` pair becomes a BF16 ``X.weight`` (exact decode); every other tensor
is copied byte for byte; each output shard keeps its source file name and tensor order. The index is rebuilt,
``config.json`` loses its ``quantization_config`` (top level and ``text_config``), and every other non-safetensors
file (tokenizer, generation config, code) is copied.

Safety:
- The whole input is validated from the headers before anything is written: the index (no shard outside the model
  dir, none missing), each shard's header (truncation, corruption), every packed weight's scale (present, uint8,
  the right shape). Scale bytes are checked as they are decoded (0xFF is NaN in E8M0).
- Output goes into ``.<OUT>.k3-convert-partial`` beside OUT; OUT appears only at the end, by a rename. A shard is
  written to ``<name>.partial``, fsynced, renamed, then recorded (size + crc32 + the source's size/mtime) in the
  folder's manifest; a rerun after a kill skips the recorded shards and ends byte-identical to an uninterrupted run.
- ``--verify`` re-reads the output before the rename: every copied tensor byte for byte, every decoded weight
  against a fresh decode, each shard's crc32, the index, config and copied files, and the text tensors against
  the released BF16 layout of the config (``k3.checkpoint.layout``).
- ``--workers N`` converts N shards at once in spawned processes (each dies with the parent). Memory per worker:
  one decoded chunk (``DECODE_CHUNK_BYTES``) plus copy buffers; shards are read piecewise, never loaded whole.
- ``--device cuda`` decodes on the GPU (``k3.kernels.mxfp4.triton``: Triton, or its torch fallback) in chunks of
  ``CUDA_DECODE_CHUNK_BYTES``; the bytes written are identical to ``--device cpu`` (same plan, same manifest, so
  a conversion may resume on the other device), and ``--verify`` still decodes on the CPU, an independent check.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from k3.checkpoint.hf_io import (
    INDEX_NAME,
    TEXT_PREFIX,
    CheckpointError,
    SafetensorsEntry,
    SafetensorsStreamWriter,
    check_output_dir,
    commit_output_dir,
    fsync_dir,
    read_config_json,
    read_safetensors_header,
    read_weight_map,
    safetensors_header,
)
from k3.config import ConfigError, K3Config
from k3.kernels.mxfp4.codec import BLOCK_SIZE, MXFP4Error, PairDecoder, packed_shapes

__all__ = [
    "ConvertResult",
    "ConversionPlan",
    "MANIFEST_NAME",
    "SLOW_SHARD_ENV",
    "convert_mxfp4_to_bf16",
    "plan_conversion",
    "staging_dir",
    "verify_conversion",
]

MANIFEST_NAME = "k3-convert-manifest.json"
MANIFEST_VERSION = 1
SLOW_SHARD_ENV = "K3_CONVERT_TEST_SLOW_SHARD_S"  # test hook: seconds each shard waits before it is finished
COPY_CHUNK_BYTES = 4 << 20  # small enough that checksumming and writing find the chunk in cache
DECODE_CHUNK_BYTES = 1 << 20  # BF16 output bytes decoded at once (cache-sized: ~40% less CPU than 64 MiB)
CUDA_DECODE_CHUNK_BYTES = 64 << 20  # on the GPU: large enough that the copies, not the launches, set the pace
DEVICES = ("cpu", "cuda")
PACKED_FORMAT = "mxfp4-pack-quantized"
_UNSUPPORTED_SUFFIXES = (".weight_global_scale", ".weight_zero_point", ".input_global_scale")


# ------------------------------------------------------------------------------------------------ the plan
@dataclass(slots=True)
class TensorOp:
    """One output tensor: ``copy`` bytes of ``src``, or ``decode`` the packed ``src`` with ``scale``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    src: SafetensorsEntry
    scale_file: str | None = None
    scale: SafetensorsEntry | None = None

    @property
    def kind(self) -> str:
        return "copy" if self.scale is None else "decode"


def _data_bytes(op: TensorOp) -> int:
    return op.src.nbytes if op.kind == "copy" else 2 * op.shape[0] * op.shape[1]


@dataclass(slots=True)
class ShardPlan:
    name: str  # the file name, the same in the source and the output
    ops: list[TensorOp]
    metadata: dict[str, str] | None
    out_size: int  # bytes of the output file
    reads: list[str]  # source shards it reads (its own, plus any holding one of its scales)


@dataclass
class ConversionPlan:
    model_dir: Path
    shards: list[ShardPlan]
    has_index: bool
    config: dict  # the output config.json
    other_files: list[Path]  # relative paths of the files copied as they are
    weight_map: dict[str, str] = field(default_factory=dict)  # output tensor -> shard

    def digest(self) -> str:
        """Identifies the conversion (shards, tensors, shapes, offsets), not the source's timestamps."""
        h = hashlib.sha256(f"v{MANIFEST_VERSION}".encode())
        for s in self.shards:
            h.update(f"|{s.name}|{s.out_size}".encode())
            for op in s.ops:
                h.update(f"{op.name}:{op.dtype}:{op.shape}:{op.src.begin}:{op.scale_file}".encode())
        return h.hexdigest()


def _quantization_config(config: dict, path: Path) -> dict:
    text = config.get("text_config")
    qc = config.get("quantization_config")
    if qc is None and isinstance(text, dict):
        qc = text.get("quantization_config")
    if qc is None:
        raise CheckpointError(f"{path}: no quantization_config: the checkpoint is already BF16, nothing to convert")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: quantization_config must be a JSON object")
    fmt = qc.get("format")
    if fmt != PACKED_FORMAT:
        raise CheckpointError(f"{path}: quantization_config.format is {fmt!r}; this converter reads {PACKED_FORMAT!r}")
    for gname, group in (qc.get("config_groups") or {}).items():
        gs = ((group or {}).get("weights") or {}).get("group_size")
        if gs not in (None, BLOCK_SIZE):
            raise CheckpointError(f"{path}: quantization_config.config_groups.{gname}.weights.group_size is {gs}; "
                                  f"MXFP4 uses {BLOCK_SIZE}")
    return qc


def _bf16_config(config: dict) -> dict:
    out = json.loads(json.dumps(config))
    out.pop("quantization_config", None)
    if isinstance(out.get("text_config"), dict):
        out["text_config"].pop("quantization_config", None)
    return out


def _other_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix == ".safetensors" or rel.as_posix() in (INDEX_NAME, "config.json"):
            continue
        out.append(rel)
    return out


def plan_conversion(model_dir: str | Path) -> ConversionPlan:
    """Validate a native MXFP4 checkpoint from its config, index and shard headers; return what to write.

    Raises CheckpointError naming the file and tensor for every problem this can see without reading tensor data.
    """
    root = Path(model_dir)
    cfg_path, config = read_config_json(root)
    _quantization_config(config, cfg_path)

    weight_map = read_weight_map(root)  # path escapes and missing shards raise here
    has_index = (root / INDEX_NAME).exists()
    index_path = root / INDEX_NAME if has_index else root / "model.safetensors"
    headers = {shard: read_safetensors_header(root / shard) for shard in sorted(set(weight_map.values()))}
    for name, shard in weight_map.items():
        if name not in headers[shard].entries:
            raise CheckpointError(f"{index_path}: tensor {name!r} is listed in {shard}, whose header lacks it")
    for shard, h in headers.items():
        for name in h.entries:
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{h.path}: tensor {name!r} is not in the index under this shard "
                                      f"(index says {weight_map.get(name)!r})")

    def entry(name: str) -> tuple[str, SafetensorsEntry]:
        shard = weight_map[name]
        return shard, headers[shard].entries[name]

    for name in weight_map:
        where = f"{root / weight_map[name]}: tensor {name!r}"
        if name.endswith(_UNSUPPORTED_SUFFIXES):
            raise CheckpointError(f"{where}: {PACKED_FORMAT} has no {name.rsplit('.', 1)[1]}; not an MXFP4 checkpoint")
        if name.endswith(".weight_scale") and name[: -len("_scale")] + "_packed" not in weight_map:
            raise CheckpointError(f"{where}: a scale without its packed weight "
                                  f"({name[: -len('_scale')] + '_packed'!r} is missing)")

    shards: list[ShardPlan] = []
    out_map: dict[str, str] = {}
    for shard, h in headers.items():
        ops: list[TensorOp] = []
        reads = {shard}
        for name, e in h.entries.items():
            where = f"{h.path}: tensor {name!r}"
            if name.endswith(".weight_scale"):
                continue  # consumed by its packed weight
            if not name.endswith(".weight_packed"):
                ops.append(TensorOp(name, e.dtype, e.shape, e))
                continue
            base = name[: -len(".weight_packed")]
            scale_name = base + ".weight_scale"
            if scale_name not in weight_map:
                raise CheckpointError(f"{where}: packed weight without its scale ({scale_name!r} is in no shard)")
            if base + ".weight" in weight_map:
                raise CheckpointError(f"{where}: both {base + '.weight'!r} and its packed form exist")
            scale_shard, s = entry(scale_name)
            if e.dtype != "U8" or len(e.shape) != 2:
                raise CheckpointError(f"{where}: weight_packed must be a 2-D U8 tensor, got {e.dtype} {list(e.shape)}")
            if s.dtype != "U8":
                raise CheckpointError(f"{root / scale_shard}: tensor {scale_name!r}: weight_scale must be U8, "
                                      f"got {s.dtype}")
            out_features, in_features = e.shape[0], 2 * e.shape[1]
            expected = packed_shapes(out_features, in_features)[1]
            if tuple(s.shape) != expected:
                raise CheckpointError(
                    f"{root / scale_shard}: tensor {scale_name!r}: scale shape mismatch: {list(s.shape)}, but "
                    f"{name!r} {list(e.shape)} packs [{out_features}, {in_features}] and needs {list(expected)}"
                )
            ops.append(TensorOp(base + ".weight", "BF16", (out_features, in_features), e, scale_shard, s))
            reads.add(scale_shard)
        head, sizes = safetensors_header([(op.name, op.dtype, op.shape) for op in ops], h.metadata)
        for op in ops:
            out_map[op.name] = shard
        shards.append(ShardPlan(shard, ops, h.metadata, len(head) + sum(n for _, n in sizes), sorted(reads)))
    return ConversionPlan(root, shards, has_index, _bf16_config(config), _other_files(root), out_map)


# ------------------------------------------------------------------------------------------------ one shard
class _Reader:
    """Positional reads from checkpoint files into reusable buffers.

    Reads (not mmap): a mapped shard counts its touched pages in the worker's RSS, up to the whole shard.
    """

    def __init__(self, root: Path, device: str = "cpu") -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._bufs: dict[str, bytearray] = {}
        if device == "cpu":
            self.decoder = PairDecoder()  # its buffers are reused across tensors too
            self.decode_chunk_bytes = DECODE_CHUNK_BYTES
        else:  # torch only where asked for: CPU workers never load it
            from k3.kernels.mxfp4.triton import TorchPairDecoder

            self.decoder = TorchPairDecoder(device)
            self.decode_chunk_bytes = CUDA_DECODE_CHUNK_BYTES

    def _fd(self, shard: str) -> int:
        if shard not in self._fds:
            self._fds[shard] = os.open(self.root / shard, os.O_RDONLY)
        return self._fds[shard]

    def read(self, shard: str, offset: int, n: int, slot: str = "a") -> memoryview:
        """``n`` bytes at ``offset``, in buffer ``slot`` (valid until the next read into the same slot)."""
        buf = self._bufs.get(slot)
        if buf is None or len(buf) < n:
            buf = self._bufs[slot] = bytearray(max(n, 1 << 20))
        view = memoryview(buf)[:n]
        got = 0
        while got < n:
            k = os.preadv(self._fd(shard), [view[got:]], offset + got)
            if k == 0:
                raise CheckpointError(f"{self.root / shard}: truncated while reading byte {offset + got}")
            got += k
        return view

    def chunks(self, shard: str, e: SafetensorsEntry, slot: str = "a"):
        """The bytes of tensor ``e`` in COPY_CHUNK_BYTES pieces."""
        for a in range(e.begin, e.end, COPY_CHUNK_BYTES):
            yield self.read(shard, a, min(COPY_CHUNK_BYTES, e.end - a), slot)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _decoded_chunks(op: TensorOp, src: _Reader, shard: str, where: str):
    """Yield a packed weight's BF16 bytes in row chunks, as ``[rows, in/2]`` uint32 arrays (two BF16 each)."""
    out_features, n_bytes = op.src.shape
    n_scales = op.scale.shape[1]
    rows = max(1, src.decode_chunk_bytes // (4 * n_bytes))
    for r in range(0, out_features, rows):
        k = min(rows, out_features - r)
        packed = np.frombuffer(src.read(shard, op.src.begin + r * n_bytes, k * n_bytes, "packed"), np.uint8)
        scale = np.frombuffer(src.read(op.scale_file, op.scale.begin + r * n_scales, k * n_scales, "scale"),
                              np.uint8)
        try:
            pairs = src.decoder.decode(packed.reshape(k, n_bytes), scale.reshape(k, n_scales))
        except MXFP4Error as e:
            msg = str(e).replace("weight_scale[", f"weight_scale[{r}+", 1) if r else str(e)
            raise CheckpointError(f"{where}: {msg}") from None
        yield pairs


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    """Equality of two byte views, 8 bytes at a time (a plain memoryview compare runs at ~1 GB/s)."""
    if len(a) != len(b):
        return False
    n8 = len(a) // 8 * 8
    return np.array_equal(np.frombuffer(a[:n8], np.uint64), np.frombuffer(b[:n8], np.uint64)) and a[n8:] == b[n8:]


def _convert_shard(root: Path, plan: ShardPlan, partial: Path, report: Callable[[int], None],
                   device: str = "cpu") -> tuple[int, str]:
    """Write one output shard to ``partial``; returns (bytes, crc32). ``report(n)`` after each n data bytes."""
    src = _Reader(root, device)
    try:
        with SafetensorsStreamWriter(partial, [(op.name, op.dtype, op.shape) for op in plan.ops], plan.metadata) as w:
            for op in plan.ops:
                if op.kind == "copy":
                    for chunk in src.chunks(plan.name, op.src):
                        w.write(op.name, chunk)
                        report(len(chunk))
                else:
                    where = f"{root / plan.name}: tensor {op.src.name!r}"
                    for pairs in _decoded_chunks(op, src, plan.name, where):
                        w.write(op.name, pairs)
                        report(pairs.nbytes)
            slow = float(os.environ.get(SLOW_SHARD_ENV, "0") or 0)
            if slow > 0:
                time.sleep(slow)
            return w.close()
    finally:
        src.close()


def _verify_shard(root: Path, out_dir: Path, plan: ShardPlan, expected_crc32: str | None,
                  report: Callable[[int], None]) -> None:
    """Re-read one output shard and compare every tensor with the source; raise CheckpointError on a mismatch."""
    path = out_dir / plan.name
    header = read_safetensors_header(path)
    got = [(e.name, e.dtype, e.shape) for e in header.entries.values()]
    want = [(op.name, op.dtype, tuple(op.shape)) for op in plan.ops]
    if got != want:
        diff = next(((g, w) for g, w in zip(got, want) if g != w), (got[len(want):], want[len(got):]))
        raise CheckpointError(f"{path}: tensors differ from the source plan: found {diff[0]}, expected {diff[1]}")
    src, out = _Reader(root), _Reader(out_dir)
    try:
        if expected_crc32 is not None:
            crc = 0
            for chunk in out.chunks(plan.name, SafetensorsEntry("", "U8", (header.file_size,), 0, header.file_size)):
                crc = zlib.crc32(chunk, crc)
            if f"{crc:08x}" != expected_crc32:
                raise CheckpointError(f"{path}: crc32 {crc:08x} differs from the manifest's {expected_crc32}")
        for op in plan.ops:
            where = f"{path}: tensor {op.name!r}"
            o = header.entries[op.name]
            if op.kind == "copy":
                for a, chunk in zip(range(o.begin, o.end, COPY_CHUNK_BYTES), src.chunks(plan.name, op.src)):
                    if not _same_bytes(out.read(plan.name, a, len(chunk)), chunk):
                        raise CheckpointError(f"{where}: bytes differ from the source tensor in {root / plan.name}")
                    report(len(chunk))
                continue
            pos = o.begin
            for pairs in _decoded_chunks(op, src, plan.name, f"{root / plan.name}: tensor {op.src.name!r}"):
                if not _same_bytes(out.read(plan.name, pos, pairs.nbytes), memoryview(pairs).cast("B")):
                    raise CheckpointError(f"{where}: differs from the MXFP4 decode of {op.src.name!r}")
                pos += pairs.nbytes
                report(pairs.nbytes)
    finally:
        src.close()
        out.close()


# ------------------------------------------------------------------------------------------------ workers
# Jobs report progress (bytes) through ``_report``: the progress bar itself when run in this process, a queue
# drained by the parent when run in a pool worker.
_report: Callable[[int], None] = lambda n: None


def _die_with_parent() -> None:
    # A killed converter must not leave workers writing into the staging folder.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_init(queue) -> None:
    global _report
    _report = queue.put
    _die_with_parent()


def _convert_job(root: str, plan: ShardPlan, partial: str, device: str = "cpu") -> tuple[str, int, str]:
    size, digest = _convert_shard(Path(root), plan, Path(partial), _report, device)
    return plan.name, size, digest


def _verify_job(root: str, out_dir: str, plan: ShardPlan, crc32: str | None) -> str:
    _verify_shard(Path(root), Path(out_dir), plan, crc32, _report)
    return plan.name


class _Workers:
    """Runs jobs ``on_done(fn(*job))`` here (``workers`` <= 1) or in a pool of spawned processes, started on first
    use and shared by conversion and verification; progress reaches ``bar`` either way."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = None
        self._queue = None

    def run(self, fn, jobs: list[tuple], bar, on_done: Callable) -> None:
        global _report
        if self.workers <= 1 or len(jobs) <= 1:
            _report = bar.update
            try:
                for job in jobs:
                    on_done(fn(*job))
            finally:
                _report = lambda n: None
            return
        if self._pool is None:
            ctx = mp.get_context("spawn")  # forking a process with threads (tqdm, torch) can deadlock the child
            self._queue = ctx.Queue()
            self._pool = ctx.Pool(self.workers, initializer=_worker_init, initargs=(self._queue,))

        def drain() -> None:
            while not self._queue.empty():
                bar.update(self._queue.get_nowait())

        pending = [self._pool.apply_async(fn, job) for job in jobs]
        while pending:
            drain()
            still = []
            for r in pending:
                if r.ready():
                    on_done(r.get())  # re-raises a worker's error here
                else:
                    still.append(r)
            pending = still
            if pending:
                pending[0].wait(0.1)
        drain()

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


# ------------------------------------------------------------------------------------------------ driver
@dataclass
class ConvertResult:
    out_dir: Path
    shards_converted: int
    shards_reused: int  # finished by an earlier, interrupted run
    bytes_written: int
    seconds: float
    verified: bool
    shard_crc32: dict[str, str]


def staging_dir(save_dir: str | Path) -> Path:
    """Where a conversion into ``save_dir`` is built: ``.<name>.k3-convert-partial`` beside it."""
    out = Path(save_dir)
    return out.parent / f".{out.name}.k3-convert-partial"


def _source_fingerprint(root: Path, shards: list[str]) -> dict[str, list[int]]:
    out = {}
    for s in shards:
        st = (root / s).stat()
        out[s] = [st.st_size, st.st_mtime_ns]
    return out


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _check_dirs(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if s == o:
        raise CheckpointError(f"--save-dir {out} is the model dir; write the BF16 checkpoint somewhere else")
    if s in o.parents:
        raise CheckpointError(f"--save-dir {out} is inside the model dir {src}; choose a folder outside it")
    if o in s.parents:
        raise CheckpointError(f"--save-dir {out} contains the model dir {src}; choose another folder")


def convert_mxfp4_to_bf16(
    model_dir: str | Path,
    save_dir: str | Path,
    workers: int = 1,
    verify: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    device: str = "cpu",
) -> ConvertResult:
    """Convert the MXFP4 checkpoint in ``model_dir`` to BF16 in ``save_dir`` (see the module docstring).

    ``device``: where packed weights are decoded, ``cpu`` or ``cuda`` (same output bytes). Resumes an interrupted
    conversion into the same ``save_dir``. Raises CheckpointError (naming the file and tensor) on bad input, or
    for ``cuda`` without a CUDA device, leaving ``save_dir`` untouched.
    """
    t0 = time.perf_counter()
    src, out = Path(model_dir), Path(save_dir)
    if workers < 1:
        raise CheckpointError(f"--workers {workers}: expected at least 1")
    _check_device(device)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    _check_dirs(src, out)
    check_output_dir(out, overwrite)
    plan = plan_conversion(src)  # every header-level problem is raised here, before anything exists on disk
    staging = staging_dir(out)
    staging.mkdir(parents=True, exist_ok=True)
    lock = _lock(staging, out)
    try:
        return _convert_locked(plan, src, out, staging, workers, verify, overwrite, progress, t0, device)
    finally:
        os.close(lock)


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise CheckpointError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cuda":
        import torch  # only here: a CPU conversion never loads torch

        if not torch.cuda.is_available():
            raise CheckpointError("--device cuda: no CUDA device is available (torch.cuda.is_available() is "
                                  "False); use --device cpu")


def _lock(staging: Path, out: Path) -> int:
    """Hold an exclusive lock on the staging folder (released when the process exits, even when killed)."""
    fd = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(f"{staging}: another conversion into {out} is running") from None
    return fd


def _convert_locked(plan: ConversionPlan, src: Path, out: Path, staging: Path, workers: int, verify: bool,
                    overwrite: bool, progress: bool, t0: float, device: str = "cpu") -> ConvertResult:
    manifest_path = staging / MANIFEST_NAME
    manifest = None
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError:
            manifest = None
    if not manifest or manifest.get("plan") != plan.digest() or manifest.get("version") != MANIFEST_VERSION:
        for p in staging.iterdir():  # another conversion's leftovers: start over (the folder itself is locked)
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        manifest = {"version": MANIFEST_VERSION, "plan": plan.digest(), "source": str(src.resolve()), "shards": {}}
    for stale in staging.glob("*.partial"):
        stale.unlink()

    done: dict[str, dict] = {}
    for s in plan.shards:
        rec = manifest["shards"].get(s.name)
        f = staging / s.name
        if (rec and rec["size"] == s.out_size and f.is_file() and f.stat().st_size == s.out_size
                and rec["source"] == _source_fingerprint(src, s.reads)):
            done[s.name] = rec
    manifest["shards"] = dict(done)
    _write_json_atomic(manifest_path, manifest)
    todo = [s for s in plan.shards if s.name not in done]
    by_name = {s.name: s for s in plan.shards}

    total = sum(s.out_size for s in plan.shards)
    reused = sum(s.out_size for s in plan.shards if s.name in done)
    with _Workers(min(workers, len(plan.shards))) as pool, tqdm(
        total=total, initial=reused, unit="B", unit_scale=True, desc="mxfp4->bf16", disable=not progress
    ) as bar:

        def finished(result: tuple[str, int, str]) -> None:
            # The worker fsynced the file; rename it, then record it, so the manifest only names complete shards.
            name, size, digest = result
            s = by_name[name]
            if size != s.out_size:
                raise CheckpointError(f"{staging / name}: wrote {size} bytes, expected {s.out_size}")
            os.replace(staging / (name + ".partial"), staging / name)
            fsync_dir(staging)
            manifest["shards"][name] = {"size": size, "crc32": digest, "source": _source_fingerprint(src, s.reads)}
            _write_json_atomic(manifest_path, manifest)
            bar.update(s.out_size - sum(_data_bytes(op) for op in s.ops))  # the header; data was reported

        jobs = [(str(src), s, str(staging / (s.name + ".partial")), device) for s in todo]
        try:
            pool.run(_convert_job, jobs, bar, finished)
        except CheckpointError as e:
            raise CheckpointError(f"{e}\n(nothing was written to {out}; the finished shards are kept in {staging} "
                                  "so a rerun resumes; delete it to start over)") from None
        bar.close()
        _finalize(plan, staging)
        if verify:
            try:
                _verify(plan, staging, pool, progress, {k: v["crc32"] for k, v in manifest["shards"].items()})
            except CheckpointError as e:
                shutil.rmtree(staging)  # a finished shard is wrong: nothing in the folder can be trusted
                raise CheckpointError(f"verification failed: {e}\n(nothing was written to {out}; the partial "
                                      "output was removed)") from None

    shard_crc32 = {k: v["crc32"] for k, v in manifest["shards"].items()}
    manifest_path.unlink()
    fsync_dir(staging)
    commit_output_dir(staging, out, overwrite)
    return ConvertResult(out, len(todo), len(done), sum(s.out_size for s in todo), time.perf_counter() - t0,
                         verify, shard_crc32)


def _finalize(plan: ConversionPlan, staging: Path) -> None:
    """Index, config and the other files."""
    if plan.has_index:
        total_size = sum(_data_bytes(op) for s in plan.shards for op in s.ops)
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(plan.weight_map.items()))}
        _write_json_atomic(staging / INDEX_NAME, index)
    _write_json_atomic(staging / "config.json", plan.config)
    for rel in plan.other_files:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(plan.model_dir / rel, staging / rel)


def _verify(plan: ConversionPlan, out: Path, pool: _Workers, progress: bool,
            expected_crc32: dict[str, str] | None) -> None:
    src = plan.model_dir
    cfg_path = out / "config.json"
    try:
        out_cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read ({e})") from e
    if out_cfg != plan.config:
        raise CheckpointError(f"{cfg_path}: differs from the source config without quantization_config")
    if plan.has_index:
        got = read_weight_map(out)
        if got != plan.weight_map:
            missing = sorted(set(plan.weight_map) - set(got))[:3]
            extra = sorted(set(got) - set(plan.weight_map))[:3]
            raise CheckpointError(f"{out / INDEX_NAME}: weight_map differs (missing {missing}, unexpected {extra})")
    for rel in plan.other_files:
        if not (out / rel).is_file() or (out / rel).read_bytes() != (src / rel).read_bytes():
            raise CheckpointError(f"{out / rel}: missing or different from {src / rel}")
    _check_released_layout(plan, out)
    total = sum(_data_bytes(op) for s in plan.shards for op in s.ops)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        jobs = [(str(src), str(out), s, (expected_crc32 or {}).get(s.name)) for s in plan.shards]
        pool.run(_verify_job, jobs, bar, lambda name: None)


def _check_released_layout(plan: ConversionPlan, out: Path) -> None:
    """The output's text tensors (``language_model.*``) must be exactly the released BF16 layout of its config."""
    from k3.checkpoint.layout import checkpoint_layout  # here: it loads torch, which worker processes never need

    try:
        cfg = K3Config.from_dict(plan.config)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{out / 'config.json'}: not a K3 config ({e})") from None
    want = {s.name: (s.safetensors_dtype, s.shape) for s in checkpoint_layout(cfg, "bf16")}
    got = {op.name: (op.dtype, tuple(op.shape)) for s in plan.shards for op in s.ops if op.name.startswith(TEXT_PREFIX)}
    if got != want:
        missing = sorted(set(want) - set(got))[:3]
        extra = sorted(set(got) - set(want))[:3]
        wrong = [f"{n} {got[n]} (expected {want[n]})" for n in sorted(set(got) & set(want)) if got[n] != want[n]][:3]
        raise CheckpointError(f"{out}: text tensors differ from the released K3 layout of config.json: "
                              f"missing {missing}, unexpected {extra}, wrong dtype/shape {wrong}")


def verify_conversion(model_dir: str | Path, out_dir: str | Path, workers: int = 1, progress: bool = True) -> None:
    """Check a BF16 checkpoint against its MXFP4 source: every tensor's name, dtype and shape, every copied
    tensor's bytes, every decoded weight against a fresh decode, the index, the config and the copied files.
    Raises CheckpointError naming the first file and tensor that differ."""
    plan = plan_conversion(model_dir)
    with _Workers(min(workers, len(plan.shards))) as pool:
        _verify(plan, Path(out_dir), pool, progress, None)
