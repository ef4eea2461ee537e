"""Checkpoint commands of the ``k3`` CLI: ``k3 make-checkpoint`` and the ``k3 convert`` group.

``k3/launch/cli.py`` registers ``make_checkpoint`` as a command and ``convert_app`` as a group. The converters
themselves live with their parts: ``mxfp4-to-bf16`` in ``k3/checkpoint/convert.py``, ``hf-to-dist`` and
``dist-to-hf`` in ``k3/megatron/convert.py`` (megatron-core is imported only when they run).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from k3.checkpoint.hf_io import CheckpointError, parse_size
from k3.config import ConfigError

__all__ = ["make_checkpoint", "convert_app"]


class Variant(str, Enum):
    tiny = "tiny"
    four_layer = "4layer"
    full = "full"


class Format(str, Enum):
    mxfp4 = "mxfp4"
    bf16 = "bf16"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(1)


def make_checkpoint(
    out: Annotated[Path, typer.Option("--out", help="Directory to write (created; must be empty or absent).")],
    variant_name: Annotated[Variant, typer.Option("--variant", help="Model size: tiny (CPU), 4layer (the first "
                                                  "four layers at full width) or full (the 2.78T release).")]
    = Variant.tiny,
    fmt: Annotated[Format, typer.Option("--format", help="mxfp4: the native release (packed routed experts); "
                                        "bf16: the converted layout.")] = Format.mxfp4,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed and config give the same bytes.")] = 0,
    max_shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 2GB, 500MB, 1GiB.")] = "2GB",
    num_experts: Annotated[int | None, typer.Option(help="Routed experts per MoE layer (default: the variant's).")]
    = None,
    num_layers: Annotated[int | None, typer.Option(help="Number of layers (default: the variant's); the KDA/MLA "
                                                   "schedule is re-derived (every 4th and the last are MLA).")]
    = None,
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists and is not empty.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar over bytes.")] = True,
    workers: Annotated[int | None, typer.Option(help="Processes that generate and write in parallel (default: "
                                                "one per CPU, at most 16, one per 256 MB of output; 1: this "
                                                "process). The bytes do not depend on it.")] = None,
    device: Annotated[Device, typer.Option("--device", help="Where values are generated: cpu, or cuda (the same "
                                           "bytes). cuda without a GPU is an error.")] = Device.cpu,
) -> None:
    """Write a synthetic Kimi-K3 checkpoint in the released layout: config.json, sharded safetensors with the \
language_model. prefix and model.safetensors.index.json, random weights at realistic scales.

    The same seed gives the same bytes on any device and worker count. Memory holds one chunk per worker, so \
every variant fits in RAM; the full one needs ~1.56 TB of disk. The output appears only when complete."""
    import time

    from k3.checkpoint.synth import phases_text, synthetic_config, write_synthetic_checkpoint

    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    try:
        cfg = synthetic_config(variant_name.value, num_experts, num_layers)
        size = parse_size(max_shard_size)
        path = write_synthetic_checkpoint(cfg, out, fmt.value, seed=seed, max_shard_size=size,
                                          overwrite=overwrite, progress=progress, workers=workers,
                                          device=device.value, timings=phases)
    except (CheckpointError, ConfigError, ValueError) as e:
        _fail(e)
    typer.echo(f"wrote {fmt.value} {variant_name.value} checkpoint to {path} in {time.perf_counter() - t0:.1f} s "
               f"({phases_text(phases)})")


convert_app = typer.Typer(
    help="Checkpoint converters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@convert_app.callback()
def _convert_group() -> None:
    """Checkpoint converters."""  # a callback keeps `convert` a group even while it has one command


@convert_app.command("mxfp4-to-bf16")
def mxfp4_to_bf16(
    model_dir: Annotated[Path, typer.Option("--model-dir", help="The native MXFP4 HF checkpoint directory.")],
    save_dir: Annotated[Path, typer.Option("--save-dir", help="Where the BF16 checkpoint goes (must be empty or "
                                           "absent unless --overwrite).")],
    workers: Annotated[int, typer.Option(help="Shards converted in parallel (processes).")] = 1,
    verify: Annotated[bool, typer.Option(help="Re-read the output and check every tensor against the source "
                                         "before it is moved into place.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace --save-dir if it exists and is not empty.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar over bytes.")] = True,
    device: Annotated[Device, typer.Option("--device", help="Where packed weights are decoded: cpu, or cuda "
                                           "(Triton; the same output bytes). cuda without a GPU is an error.")]
    = Device.cpu,
) -> None:
    """Convert the native MXFP4 checkpoint to BF16: packed routed experts are decoded exactly, every other \
tensor is copied bit for bit, quantization_config is dropped, tokenizer and other files are copied.

    The output is built in .<save-dir>.k3-convert-partial beside --save-dir and renamed at the end; rerunning \
the same command after an interruption resumes from the finished shards."""
    from k3.checkpoint.convert import convert_mxfp4_to_bf16

    try:
        r = convert_mxfp4_to_bf16(model_dir, save_dir, workers=workers, verify=verify, overwrite=overwrite,
                                  progress=progress, device=device.value)
    except CheckpointError as e:
        _fail(e)
    resumed = f", {r.shards_reused} reused from an interrupted run" if r.shards_reused else ""
    checked = ", verified" if r.verified else ""
    size = f"{r.bytes_written / 1e9:.2f} GB" if r.bytes_written >= 1e8 else f"{r.bytes_written / 1e6:.2f} MB"
    typer.echo(f"wrote {r.out_dir}: {r.shards_converted} shards converted{resumed}{checked} ({size} in "
               f"{r.seconds:.1f} s)")


# The megatron converters live with the megatron backend (k3/megatron/convert.py; megatron is imported lazily).
from k3.megatron.convert import dist_to_hf, hf_to_dist  # noqa: E402

convert_app.command("hf-to-dist")(hf_to_dist)
convert_app.command("dist-to-hf")(dist_to_hf)
