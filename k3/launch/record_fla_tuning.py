"""`k3 record-fla-tuning`: turn Triton's autotune printout into the fla config files k3 pins per GPU.

The parsing, writing and pinning live with the KDA op (``k3/kernels/kda/tuning.py``); this is the command line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from k3.kernels.kda.tuning import parse_autotune_log, write_config_dir

__all__ = ["record_fla_tuning"]


def record_fla_tuning(
    logs: Annotated[list[Path], typer.Argument(help="logs of runs made with TRITON_PRINT_AUTOTUNING=1")],
    out: Annotated[Path, typer.Option(help="config folder, e.g. k3/kernels/kda/fla_tuned/NVIDIA_H200 (merged into)")],
    fla_core: Annotated[str, typer.Option(help="fla-core version the logs were made with")],
    triton: Annotated[str, typer.Option(help="Triton version the logs were made with")],
    compute_capability: Annotated[str | None, typer.Option(
        help="the GPU's compute capability, e.g. 9.0 (torch.cuda.get_device_capability): GPUs of that capability "
             "without a folder of their own use this one")] = None,
) -> None:
    """Record Triton's autotune results (printed with TRITON_PRINT_AUTOTUNING=1) as fla config files, which
    k3 pins on every host with that GPU (k3/kernels/kda/tuning.py)."""
    configs = []
    for log in logs:
        try:
            configs += parse_autotune_log(log.read_text(errors="replace"), str(log))
        except OSError as e:
            raise typer.BadParameter(f"{log}: {e.strerror}") from None
    if not configs:
        raise typer.BadParameter("no 'Triton autotuning for function' blocks found: run with "
                                 "TRITON_PRINT_AUTOTUNING=1")
    if compute_capability is not None and not re.fullmatch(r"[0-9]+\.[0-9]+", compute_capability):
        raise typer.BadParameter(f"--compute-capability {compute_capability!r}: expected MAJOR.MINOR, e.g. 9.0")
    versions = {"fla-core": fla_core, "triton": triton}
    if compute_capability is not None:
        versions["compute_capability"] = compute_capability
    written = write_config_dir(configs, out, versions)
    typer.echo(f"{len(configs)} results, {len(written)} kernels -> {out}")
