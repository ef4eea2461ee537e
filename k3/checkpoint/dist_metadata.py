"""A torch_dist (megatron ``dist_checkpointing``) checkpoint seen from its metadata alone: where its files are, the
global shape of every tensor it holds, the K3 config stored beside it, and the shapes a checkpoint of a given K3
config must hold. No tensor data is read and no process group is needed, so ``k3 train --dry-run`` can check a
``--ref-load`` against ``--hf-checkpoint`` in well under a second.

A checkpoint written by ``k3 convert hf-to-dist`` (``k3.megatron.checkpoint.save_dist``) is laid out as::

    SAVE/latest_checkpointed_iteration.txt      "release" (or an iteration number), written last
    SAVE/release/.metadata                      torch.distributed.checkpoint's index: names, global shapes
    SAVE/release/metadata.json                  megatron's marker (sharded backend torch_dist)
    SAVE/release/k3_config.json                 the K3 config of the model (the HF wrapper layout)
    SAVE/release/__0_0.distcp ...               the data

Megatron tensor names are ``k3.checkpoint.names``' (global layer indices, whole tensors: the routed experts of a
layer are one ``[E, …]`` tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3.checkpoint.hf_io import TEXT_PREFIX, CheckpointError
from k3.checkpoint.layout import checkpoint_layout
from k3.checkpoint.names import _all_parts, megatron_names
from k3.config import ConfigError, K3Config

__all__ = ["DistMetadata", "TRACKER_NAME", "DCP_METADATA_NAME", "MEGATRON_METADATA_NAME", "K3_CONFIG_NAME",
           "dist_checkpoint_files", "read_dist_metadata", "dist_tensor_shapes"]

TRACKER_NAME = "latest_checkpointed_iteration.txt"
DCP_METADATA_NAME = ".metadata"
MEGATRON_METADATA_NAME = "metadata.json"
K3_CONFIG_NAME = "k3_config.json"
_RELEASE = "release"


@dataclass(frozen=True)
class DistMetadata:
    """What a torch_dist checkpoint holds. ``directory``: the iteration directory with the files; ``shapes``:
    megatron tensor name -> global shape (tensors only; megatron's ``_extra_state`` byte blobs are left out);
    ``config``: the stored K3 config (None when ``k3_config.json`` is absent) and ``config_path`` its file."""

    directory: Path
    shapes: dict[str, tuple[int, ...]]
    config: K3Config | None
    config_path: Path


def dist_checkpoint_files(load: str | Path) -> Path:
    """The directory holding a torch_dist checkpoint's files: the iteration the tracker file names (``release`` or
    ``iter_NNNNNNN``), or ``load`` itself when it holds the files (no tracker).

    Raises ``CheckpointError`` naming the path and what is missing: ``load`` absent or not a directory, a tracker
    that names no directory, no ``.metadata`` (not a torch_dist checkpoint, or its writing did not finish), no
    megatron ``metadata.json``.
    """
    load = Path(load)
    if not load.exists():
        raise CheckpointError(f"{load} does not exist")
    if not load.is_dir():
        raise CheckpointError(f"{load} is not a directory (a torch_dist checkpoint is a directory)")
    tracker = load / TRACKER_NAME
    if tracker.is_file():
        it = tracker.read_text(encoding="utf-8", errors="replace").strip()
        if it == _RELEASE:
            ckpt = load / _RELEASE
        elif it.isdigit():
            ckpt = load / f"iter_{int(it):07d}"
        else:
            raise CheckpointError(f"{tracker} holds {it!r}: expected 'release' or an iteration number")
        if not ckpt.is_dir():
            raise CheckpointError(f"{tracker} names {it!r}, but {ckpt} is not a directory")
    else:
        ckpt = load
    if not (ckpt / DCP_METADATA_NAME).is_file():
        found = "" if ckpt != load else f" and no {TRACKER_NAME}"
        raise CheckpointError(f"{ckpt} has no {DCP_METADATA_NAME}{found}: not a torch_dist checkpoint, or its writing "
                              "did not finish")
    if not (ckpt / MEGATRON_METADATA_NAME).is_file():
        raise CheckpointError(f"{ckpt} has {DCP_METADATA_NAME} but no megatron {MEGATRON_METADATA_NAME}: not a "
                              "checkpoint of megatron's dist_checkpointing")
    return ckpt


def read_dist_metadata(load: str | Path) -> DistMetadata:
    """Names and global shapes of every tensor of the torch_dist checkpoint ``load`` (from ``.metadata``, through
    ``torch.distributed.checkpoint.FileSystemReader.read_metadata``) and its stored K3 config. Reads no tensor
    data. Raises ``CheckpointError`` as :func:`dist_checkpoint_files`, and when ``.metadata`` or ``k3_config.json``
    cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = dist_checkpoint_files(load)
    try:
        meta = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file raises pickle/EOF/anything
        raise CheckpointError(f"{ckpt / DCP_METADATA_NAME}: cannot be read ({type(e).__name__}: {e})") from None
    shapes = {key: tuple(int(n) for n in item.size) for key, item in meta.state_dict_metadata.items()
              if isinstance(item, TensorStorageMetadata)}
    config_path = ckpt / K3_CONFIG_NAME
    config = None
    if config_path.is_file():
        try:
            config = K3Config.from_json(config_path)
        except (ConfigError, OSError, TypeError) as e:
            raise CheckpointError(f"{config_path}: not a K3 config ({e})") from None
    return DistMetadata(ckpt, shapes, config, config_path)


def dist_tensor_shapes(cfg: K3Config) -> dict[str, tuple[int, ...]]:
    """Megatron name -> global shape of every tensor a torch_dist checkpoint of ``cfg`` holds (what
    ``k3 convert hf-to-dist`` writes): the HF shapes of the converted (BF16) layout put together as
    ``k3.checkpoint.names`` puts the tensors together (``cat`` on dim 0, ``A_log`` without its padding, the routed
    experts stacked on a new dim 0)."""
    hf = {spec.name[len(TEXT_PREFIX):]: spec.shape for spec in checkpoint_layout(cfg, "bf16")}
    parts = _all_parts(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for name in megatron_names(cfg):
        part = parts[name]
        if part.kind == "same":
            out[name] = hf[part.hf_names[0]]
        elif part.kind == "a_log":
            out[name] = (cfg.linear_attn_config.num_heads,)
        elif part.kind == "cat":
            out[name] = _cat_shape([hf[n] for n in part.hf_names])
        else:  # experts: every expert has the shape of expert 0 (checkpoint_layout gives them one shape)
            out[name] = (len(part.hf_names), *_cat_shape([hf[n] for n in part.hf_names[0]]))
    return out


def _cat_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    return (sum(s[0] for s in shapes), *shapes[0][1:])

