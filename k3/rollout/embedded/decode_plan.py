"""How the embedded engine decodes on its device: ``DecodeSettings`` resolved against the device and the model.

``auto`` picks the fastest path that runs here (CUDA: CUDA graphs over the static cache, flashinfer's MLA kernel and
sampler where flashinfer imports and the model is BF16/FP16, the model's small ops as one Triton kernel each where
Triton imports; elsewhere: the static cache at host positions). An explicit choice that cannot run here is refused
with the reason; what ``auto`` left out is said in the plan's notes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.kernels.availability import triton_runs_on
from k3.kernels.mla_decode.flashinfer import flashinfer_missing, mla_shape_problem
from k3.model import KimiK3ForCausalLM
from k3.model.mla import MLAttention
from k3.settings.decode import DecodeSettings

__all__ = ["DecodePlan", "WINDOW_MODES", "resolve_decode"]

WINDOW_MODES = ("window", "graph")  # the modes that read the static cache at its device position
_FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecodePlan:
    """The resolved decode: ``mode`` (eager | static | window | graph), ``mla_kernel`` (torch | flashinfer; the
    window modes' MLA attention), ``sampler`` (torch | flashinfer), the stop-check interval, the graph buckets,
    ``small_ops`` (torch | triton: the window modes' small ops, ``k3.settings.decode``), and ``notes``: why
    ``auto`` did not take something."""

    mode: str
    mla_kernel: str
    sampler: str
    stop_check_interval: int
    graph_batch_sizes: tuple[int, ...]
    notes: tuple[str, ...] = ()
    small_ops: str = "torch"

    def bucket(self, batch: int) -> int:
        """Rows a graph runs a batch of ``batch`` in: the smallest listed size that holds it, else the batch."""
        return next((n for n in self.graph_batch_sizes if n >= batch), batch)

    def describe(self) -> str:
        kernel = (f", MLA attention {self.mla_kernel}, small ops {self.small_ops}" if self.mode in WINDOW_MODES
                  else "")
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return (f"decode mode {self.mode}{kernel}, sampler {self.sampler}, stop check every "
                f"{self.stop_check_interval} steps{notes}")


def _absorb_problem(model: KimiK3ForCausalLM) -> str | None:
    for m in model.modules():
        if isinstance(m, MLAttention):
            try:
                m.absorbed_kv_b()
            except ValueError as e:
                return str(e)
    return None


def _latent_dtype(model: KimiK3ForCausalLM) -> torch.dtype:
    return model.model.embed_tokens.weight.dtype


def _flashinfer_mla_problem(model: KimiK3ForCausalLM, dtype: torch.dtype) -> str | None:
    """Why flashinfer's MLA kernel cannot serve this model (its dtype or its latent shape), None when it can."""
    if dtype not in _FLASHINFER_DTYPES:
        return f"the model is {dtype}, flashinfer's MLA kernel takes BF16/FP16"
    cfg = model.config
    return mla_shape_problem(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def resolve_decode(settings: DecodeSettings, device: torch.device, model: KimiK3ForCausalLM) -> DecodePlan:
    """Resolve ``settings`` for ``model`` on ``device``; ValueError for an explicit choice that cannot run here."""
    notes: list[str] = []
    cuda = device.type == "cuda"
    mode = settings.mode
    if mode == "auto":
        mode = "graph" if cuda else "static"
    if mode == "graph" and not cuda:
        raise ValueError(f"decode mode graph: CUDA graphs need a CUDA device, the engine runs on {device} "
                         "(use static or window)")
    if mode in WINDOW_MODES:
        problem = _absorb_problem(model)
        if problem is not None:
            if settings.mode != "auto":
                raise ValueError(f"decode mode {mode}: {problem}")
            notes.append(f"static, not graph: {problem}")
            mode = "static"

    mla_kernel = settings.mla_kernel
    fi_missing = flashinfer_missing(device)
    dtype = _latent_dtype(model)
    if mla_kernel == "flashinfer":
        if mode not in WINDOW_MODES:
            raise ValueError(f"mla_kernel flashinfer runs in the window modes (window, graph), not in mode {mode}")
        problem = fi_missing or _flashinfer_mla_problem(model, dtype)
        if problem is not None:
            raise ValueError(f"mla_kernel flashinfer: {problem}")
    elif mla_kernel == "auto":
        mla_kernel = "torch"
        if mode in WINDOW_MODES:
            problem = fi_missing or _flashinfer_mla_problem(model, dtype)
            if problem is None:
                mla_kernel = "flashinfer"
            else:
                notes.append(f"MLA attention torch: {problem}")

    small_ops = settings.small_ops
    triton_here = cuda and triton_runs_on(device)
    if small_ops == "triton":
        if mode not in WINDOW_MODES:
            raise ValueError(f"small_ops triton runs in the window modes (window, graph), not in mode {mode}")
        if not triton_here:
            raise ValueError(f"small_ops triton: needs a CUDA device with Triton, the engine runs on {device}"
                             + ("" if not cuda else " and Triton does not import"))
    elif small_ops == "auto":
        small_ops = "triton" if mode in WINDOW_MODES and triton_here else "torch"
        if mode in WINDOW_MODES and cuda and not triton_here:
            notes.append("small ops torch: Triton does not import")

    sampler = settings.sampler
    if sampler == "flashinfer" and fi_missing is not None:
        raise ValueError(f"sampler flashinfer: {fi_missing}")
    if sampler == "auto":
        sampler = "flashinfer" if fi_missing is None else "torch"
    return DecodePlan(mode, mla_kernel, sampler, settings.stop_check_interval, tuple(settings.graph_batch_sizes),
                      tuple(notes), small_ops)
