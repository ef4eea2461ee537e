"""Weights in and out of a (sharded) K3 megatron model.

- ``load_global_tensors``: fill this rank's shards from *global* tensors (Megatron names, unsharded), fetched
  one at a time; ``load_hf_state_dict`` / ``load_hf_checkpoint`` feed it from an HF state dict / BF16
  checkpoint directory through ``k3.checkpoint.names`` (an EP rank reads only its own experts).
- ``save_dist`` / ``load_dist``: megatron ``dist_checkpointing`` (torch_dist) checkpoints, written as the
  recipe's ``release`` iteration with the tracker file last (the success signal), loadable under any layout.
- ``read_dist_tensors``: stream the global tensors of a torch_dist checkpoint in one process, no model needed.

Which slice a rank owns comes from the model's own ``sharded_state_dict`` (global offsets and shapes), so
loading can never disagree with saving.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.dict_utils import nested_values
from safetensors import safe_open
from tqdm.auto import tqdm

from k3.checkpoint.hf_io import TEXT_PREFIX, CheckpointError, read_weight_map
from k3.checkpoint.names import EXPERT_FC1, EXPERT_FC2, megatron_tensor
from k3.config import K3Config
from k3.megatron.linears import without_adapters

__all__ = [
    "local_shards",
    "shard_of",
    "load_global_tensors",
    "load_hf_state_dict",
    "load_hf_checkpoint",
    "save_dist",
    "DEFAULT_SAVE_WRITERS",
    "load_dist",
    "read_dist_tensors",
    "read_dist_config",
    "check_save_dir",
    "dist_checkpoint_dir",
    "TRACKER_NAME",
    "RELEASE",
]

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
K3_CONFIG_NAME = "k3_config.json"
DEFAULT_SAVE_WRITERS = 2  # megatron's own default for its torch_dist save (thread_count)

Fetch = Callable[[str, range | None], torch.Tensor]


def local_shards(model: torch.nn.Module) -> list[ShardedTensor]:
    """This rank's ShardedTensors of ``model`` (fused halves split, adapters and extra state left out)."""
    sharded = without_adapters(model.sharded_state_dict())
    apply_factories(sharded)
    return [sh for sh in nested_values(sharded) if isinstance(sh, ShardedTensor)]


def shard_of(full: torch.Tensor, sh: ShardedTensor, experts_only: bool = False) -> torch.Tensor:
    """The slice of global tensor ``full`` that ShardedTensor ``sh`` holds (a view). ``experts_only``: ``full``
    holds just this rank's experts along dim 0 already."""
    index = []
    for axis, (offset, size) in enumerate(zip(sh.global_offset, sh.local_shape)):
        start = 0 if experts_only and axis == 0 else offset
        index.append(slice(start, start + size))
    return full[tuple(index)]


def _is_expert_key(key: str) -> bool:
    return key.endswith((EXPERT_FC1, EXPERT_FC2))


@torch.no_grad()
def load_global_tensors(model: torch.nn.Module, fetch: Fetch, progress: bool = False) -> int:
    """Copy each of this rank's shards out of the global tensor ``fetch(name, experts)``.

    ``experts`` is the range of global experts this rank holds for stacked expert tensors (so the fetch may
    build just those) and None otherwise. Returns the number of tensors loaded; a shape mismatch raises
    ``CheckpointError`` naming the tensor. ``progress`` shows a bar (on global rank 0 only).
    """
    count = 0
    shards = local_shards(model)
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    for sh in tqdm(shards, desc="loading tensors", unit="tensor", disable=not show):
        if sh.prepend_axis_num:
            raise CheckpointError(f"{sh.key}: has {sh.prepend_axis_num} prepended axes; K3 checkpoints use "
                                  "global layer numbers (hetereogenous_dist_checkpoint=True)")
        experts = None
        if _is_expert_key(sh.key):
            start = sh.global_offset[0]
            experts = range(start, start + sh.local_shape[0])
        full = fetch(sh.key, experts)
        want = list(sh.global_shape)
        if experts is not None:
            want[0] = len(experts)
        if list(full.shape) != want:
            raise CheckpointError(f"{sh.key}: source tensor has shape {tuple(full.shape)}, the model expects "
                                  f"{tuple(want)}")
        sh.data.copy_(shard_of(full, sh, experts_only=experts is not None).to(dtype=sh.data.dtype))
        count += 1
    return count


def load_hf_state_dict(model: torch.nn.Module, hf: Mapping[str, torch.Tensor], cfg: K3Config) -> int:
    """Fill the model from an HF state dict (names after ``language_model.``, e.g. the reference's
    ``state_dict()``)."""

    def read(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"HF tensor {name!r} is missing from the state dict")
        return hf[name]

    return load_global_tensors(model, lambda key, experts: megatron_tensor(key, read, cfg, experts))


def load_hf_checkpoint(model: torch.nn.Module, hf_dir: str | Path, cfg: K3Config, progress: bool = False) -> int:
    """Fill the model from a BF16 HF checkpoint directory, opening each shard once and reading only the
    tensors this rank needs."""
    root = Path(hf_dir)
    weight_map = read_weight_map(root)
    packed = [n for n in weight_map if n.endswith(".weight_packed")]
    if packed:
        raise CheckpointError(f"{root}: holds packed MXFP4 tensors (e.g. {packed[0]}); convert it first with "
                              f"k3 convert mxfp4-to-bf16 --model-dir {root} --save-dir <BF16_DIR>")
    handles: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        full = TEXT_PREFIX + name
        shard = weight_map.get(full)
        if shard is None:
            raise CheckpointError(f"{root}: tensor {full!r} is not in the checkpoint")
        if shard not in handles:
            handles[shard] = safe_open(str(root / shard), framework="pt", device="cpu")
        return handles[shard].get_tensor(full)

    try:
        return load_global_tensors(model, lambda key, experts: megatron_tensor(key, read, cfg, experts), progress)
    finally:
        handles.clear()


def dist_checkpoint_dir(save: str | Path) -> Path:
    """The directory holding the torch_dist files of a saved checkpoint (``SAVE/release``)."""
    return Path(save) / RELEASE


def save_dist(model: torch.nn.Module, save: str | Path, cfg: K3Config,
              writers: int = DEFAULT_SAVE_WRITERS) -> Path:
    """Write the base model (no adapters) as a torch_dist checkpoint under ``save/release``; every rank calls it.

    ``writers``: processes per rank that write its files in parallel (megatron's torch_dist strategy,
    ``thread_count``: one ``.distcp`` file each; ``bench/hf_to_dist.py`` times the choice). The K3 config is stored
    beside it (``release/k3_config.json``) and the tracker file ``latest_checkpointed_iteration.txt`` (``release``)
    is written last, after every rank finished.
    """
    if writers < 1:
        raise ValueError(f"save_dist: writers={writers}: expected at least 1")
    save = Path(save)
    ckpt = dist_checkpoint_dir(save)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    check_save_dir(save)  # every rank, before any collective: a rank that raised must not leave others waiting
    _barrier()
    if rank0:
        ckpt.mkdir(parents=True, exist_ok=True)
    _barrier()
    sharded = without_adapters(model.sharded_state_dict())
    with _checkpoint_io_without_cuda():
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=writers)
        dist_checkpointing.save(sharded, str(ckpt), strategy)
    _barrier()
    if rank0:
        (ckpt / K3_CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        (save / TRACKER_NAME).write_text(RELEASE + "\n")
    _barrier()
    return ckpt


def check_save_dir(save: str | Path) -> None:
    """Raise ``CheckpointError`` when ``save`` already holds a checkpoint (or any torch_dist files)."""
    save = Path(save)
    ckpt = dist_checkpoint_dir(save)
    if save.exists() and not save.is_dir():
        raise CheckpointError(f"{save}: exists and is not a directory")
    if (save / TRACKER_NAME).exists() or (ckpt.exists() and any(ckpt.iterdir())):
        raise CheckpointError(f"{save}: already holds a checkpoint; choose an empty --save directory")


def load_dist(model: torch.nn.Module, load: str | Path) -> None:
    """Load a torch_dist checkpoint written by ``save_dist`` (under any TP/EP layout) into ``model``."""
    ckpt = _resolve_dist_dir(load)
    sharded = without_adapters(model.sharded_state_dict())
    with _checkpoint_io_without_cuda():
        state = dist_checkpointing.load(sharded, str(ckpt))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".lora." not in f".{k}" and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt}: loading left {len(missing)} model tensors unset ({missing[:5]}) and "
                              f"{len(unexpected)} unexpected ({list(unexpected)[:5]})")


def _resolve_dist_dir(load: str | Path) -> Path:
    load = Path(load)
    tracker = load / TRACKER_NAME
    if tracker.exists():
        it = tracker.read_text().strip()
        ckpt = load / (RELEASE if it == RELEASE else f"iter_{int(it):07d}")
    elif (load / "metadata.json").exists():
        ckpt = load
    else:
        raise CheckpointError(f"{load}: no {TRACKER_NAME} and no torch_dist metadata.json: not a checkpoint "
                              "written by k3 convert hf-to-dist (or it did not finish)")
    if not (ckpt / "metadata.json").exists():
        raise CheckpointError(f"{ckpt}: missing metadata.json; the checkpoint is incomplete")
    return ckpt


def read_dist_config(load: str | Path) -> K3Config:
    """The K3 config stored with a checkpoint by ``save_dist``."""
    path = _resolve_dist_dir(load) / K3_CONFIG_NAME
    if not path.exists():
        raise CheckpointError(f"{path}: missing; pass the model's config.json explicitly")
    return K3Config.from_json(path)


def read_dist_tensors(load: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every global tensor of a torch_dist checkpoint as ``(megatron name, tensor)``, in one process (no process
    group, no model). Tensors are read one layer at a time, so memory holds one layer."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = _resolve_dist_dir(load)
    meta = FileSystemReader(str(ckpt)).read_metadata()
    groups: dict[str, list[tuple[str, TensorStorageMetadata]]] = {}
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):  # the rest are megatron's extra-state objects
            m = re.match(r"^decoder\.layers\.(\d+)\.", key)
            groups.setdefault(f"layer {int(m.group(1)):06d}" if m else "top", []).append((key, item))
    for _, items in sorted(groups.items()):
        tensors = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype) for key, item in items}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(tensors, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
        yield from sorted(tensors.items())


@contextlib.contextmanager
def _checkpoint_io_without_cuda():
    """On a CPU-only torch (gloo), give megatron's checkpoint I/O the two CUDA calls it makes unconditionally.

    The torch_dist writer ends its device-to-host copy with ``torch.cuda.synchronize()`` and broadcasts its
    status in a tensor on ``torch.cuda.current_device()``; both assert without CUDA. With CPU tensors there is
    nothing to wait for and the CPU is the device. With CUDA this does nothing.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
