"""``k3 convert hf-to-dist`` and ``k3 convert dist-to-hf``: BF16 HF checkpoint <-> megatron torch_dist checkpoint.

hf-to-dist runs under ``torchrun --nproc-per-node N`` (gloo on CPU, NCCL on GPU): every rank builds its shard
of the K3 megatron model for the requested TP/EP/PP layout, fills it from the HF files (reading only the
tensors, and the routed experts, it owns) and megatron ``dist_checkpointing`` writes the torch_dist checkpoint
``SAVE/release`` plus the tracker file, written last. Training then loads it under any other layout (DCP
re-shards at load), e.g. as ``--ref-load``.

dist-to-hf is one process: it streams the global tensors out of the checkpoint (no model, no process group),
maps the names back (``k3.checkpoint.names``) and writes the released HF layout (``language_model.`` names,
sharded safetensors, index, ``config.json`` without quantization_config).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from tqdm.auto import tqdm

from k3.checkpoint.hf_io import INDEX_NAME, TEXT_PREFIX, CheckpointError, ShardedWriter, parse_size, read_weight_map
from k3.checkpoint.names import NameMapError, hf_names, hf_tensors, megatron_names
from k3.config import ConfigError, K3Config
from k3.settings.parallel import ParallelLayout

__all__ = ["hf_to_dist", "dist_to_hf", "convert_hf_to_dist", "convert_dist_to_hf"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(1)


def convert_hf_to_dist(hf_checkpoint: Path, save: Path, tp: int = 1, ep: int = 1, pp: int = 1,
                       dtype: torch.dtype = torch.bfloat16, progress: bool = True, writers: int = 2) -> Path:
    """The conversion itself (every rank calls it); returns the torch_dist directory. ``writers``: processes per
    rank writing its files (``save_dist``)."""
    from k3.megatron.checkpoint import check_save_dir, load_hf_checkpoint, save_dist
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.model import k3_model_provider
    from k3.megatron.parallel import destroy_parallel, init_parallel

    # Checks every rank makes before the first collective, so a bad input fails everywhere at once.
    cfg = K3Config.from_json(hf_checkpoint)
    weight_map = read_weight_map(hf_checkpoint)
    packed = [n for n in weight_map if n.endswith(".weight_packed")]
    if packed or cfg.is_quantized:
        what = packed[0] if packed else "quantization_config in config.json"
        raise CheckpointError(f"{hf_checkpoint}: is the native MXFP4 checkpoint ({what}); convert it first: "
                              f"k3 convert mxfp4-to-bf16 --model-dir {hf_checkpoint} --save-dir <BF16_DIR>")
    missing = sorted(set(TEXT_PREFIX + n for n in hf_names(cfg)) - set(weight_map))
    if missing:
        raise CheckpointError(f"{hf_checkpoint}: {len(missing)} tensors of the model are missing, e.g. {missing[:3]}")
    check_save_dir(save)
    if writers < 1:
        raise ValueError(f"--save-writers {writers}: expected at least 1")
    layout = ParallelLayout.model_parallel(tp=tp, ep=ep, pp=pp)
    config = k3_transformer_config(cfg, layout, params_dtype=dtype, dispatcher="allgather",
                                   perform_initialization=False)  # validates divisibility
    init_parallel(layout, seed=None)
    try:
        model = k3_model_provider(config)
        if torch.cuda.is_available():
            model = model.cuda()
        load_hf_checkpoint(model, hf_checkpoint, cfg, progress=progress)
        return save_dist(model, save, cfg, writers)
    finally:
        destroy_parallel()


def convert_dist_to_hf(load: Path, save: Path, max_shard_size: int = 2_000_000_000, progress: bool = True,
                       overwrite: bool = False) -> Path:
    """Write the HF checkpoint of a torch_dist checkpoint (one process); returns ``save``."""
    from k3.megatron.checkpoint import read_dist_config, read_dist_tensors

    cfg = read_dist_config(load)
    save = Path(save)
    if save.exists() and any(save.iterdir()) and not overwrite:
        raise CheckpointError(f"{save}: exists and is not empty (pass --overwrite to replace it)")
    expected = set(megatron_names(cfg))
    seen: set[str] = set()
    writer = ShardedWriter(save, max_shard_size)
    for name, tensor in tqdm(read_dist_tensors(load), total=len(expected), desc="writing", unit="tensor",
                             disable=not progress):
        if name not in expected:
            raise CheckpointError(f"{load}: tensor {name!r} is not a parameter of the K3 model in its config")
        seen.add(name)
        for hf_name, t in hf_tensors(name, tensor, cfg):
            writer.add(TEXT_PREFIX + hf_name, t.contiguous().clone())
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"{load}: {len(missing)} model tensors are missing from the checkpoint, e.g. "
                              f"{missing[:3]}")
    writer.close()
    (save / "config.json").write_text(json.dumps(cfg.replace(quantization_config=None).to_hf_dict(), indent=2)
                                      + "\n")
    return save


def hf_to_dist(
    hf_checkpoint: Annotated[Path, typer.Option("--hf-checkpoint", help="The BF16 HF checkpoint directory "
                                                "(k3 convert mxfp4-to-bf16 makes one from the release).")],
    save: Annotated[Path, typer.Option("--save", help="Where the torch_dist checkpoint goes (SAVE/release + "
                                       "the tracker file); must not hold a checkpoint.")],
    tensor_model_parallel_size: Annotated[int, typer.Option("--tensor-model-parallel-size",
                                                            help="TP size of the model built for the save.")] = 1,
    expert_model_parallel_size: Annotated[int, typer.Option("--expert-model-parallel-size",
                                                            help="EP size (routed experts per rank = E / EP).")]
    = 1,
    pipeline_model_parallel_size: Annotated[int, typer.Option("--pipeline-model-parallel-size",
                                                              help="PP size.")] = 1,
    dtype: Annotated[str, typer.Option(help="Dtype of the saved weights: bfloat16 or float32 (the F32 "
                                       "tensors of the checkpoint stay float32).")] = "bfloat16",
    progress: Annotated[bool, typer.Option(help="Show a progress bar (rank 0).")] = True,
    save_writers: Annotated[int, typer.Option(
        help="Processes per rank that write its torch_dist files in parallel, one file each (megatron's default: "
             "2).")] = 2,
) -> None:
    """Convert a BF16 HF checkpoint to a megatron torch_dist checkpoint; run it under torchrun.

    torchrun --nproc-per-node N -m k3 convert hf-to-dist --hf-checkpoint BF16 --save DCP \
--tensor-model-parallel-size T --expert-model-parallel-size E (N a multiple of T·PP and of E·PP). \
The result loads under any other layout (DCP re-shards at load)."""
    if dtype not in _DTYPES:
        _fail(ValueError(f"--dtype {dtype!r}: expected one of {sorted(_DTYPES)}"))
    start = time.time()
    try:
        ckpt = convert_hf_to_dist(hf_checkpoint, save, tensor_model_parallel_size, expert_model_parallel_size,
                                  pipeline_model_parallel_size, _DTYPES[dtype], progress, save_writers)
    except (CheckpointError, ConfigError, NameMapError, ValueError) as e:
        _fail(e)
    if _rank() == 0:
        typer.echo(f"wrote {ckpt} (TP={tensor_model_parallel_size}, EP={expert_model_parallel_size}, "
                   f"PP={pipeline_model_parallel_size}) in {time.time() - start:.1f} s")


def dist_to_hf(
    load: Annotated[Path, typer.Option("--load", help="The torch_dist checkpoint (the --save of hf-to-dist).")],
    save: Annotated[Path, typer.Option("--save", help="Where the HF checkpoint goes (empty or absent).")],
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 2GB, 500MB.")] = "2GB",
    overwrite: Annotated[bool, typer.Option(help="Write into --save even if it is not empty.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Convert a megatron torch_dist checkpoint back to the HF layout (one process, any source layout): \
language_model. names, sharded safetensors, model.safetensors.index.json and config.json."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _fail(ValueError("dist-to-hf runs as one process; start it without torchrun"))
    try:
        out = convert_dist_to_hf(load, save, parse_size(max_shard_size), progress, overwrite)
    except (CheckpointError, ConfigError, NameMapError, ValueError) as e:
        _fail(e)
    n = len(json.loads((out / INDEX_NAME).read_text())["weight_map"])
    typer.echo(f"wrote {out}: {n} tensors")
