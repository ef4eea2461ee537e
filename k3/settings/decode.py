"""Decode settings of the embedded engine: how one generation pass runs on its device.

Pure data: the standard library only. ``k3.rollout.embedded`` resolves ``auto`` against the device it runs on and
logs what it fell back from.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DECODE_MODES", "DecodeSettings", "SMALL_OP_KERNELS", "GRAPH_BATCH_SIZES", "MLA_KERNELS", "SAMPLERS",
           "STOP_CHECK_INTERVAL"]

# eager: the plain reference (a grown K3Cache, the mask concatenated per step); static: a preallocated
# StaticK3Cache at host positions, the reference's very operations (bit-identical on CPU); window: the static cache
# read at its device-side position, MLA in the absorbed form over the whole window (no host state per step);
# graph: window with one CUDA graph per batch-size bucket (CUDA only); auto: graph on CUDA, static elsewhere.
DECODE_MODES = ("auto", "eager", "static", "window", "graph")
# The window modes' MLA attention: torch (k3.kernels.mla_decode.naive) or flashinfer's paged MLA kernel; auto:
# flashinfer where it imports on CUDA with a BF16/FP16 model, else torch.
MLA_KERNELS = ("auto", "torch", "flashinfer")
# The window modes' small ops (RMSNorm, SiTU, the AttnRes mix, KDA's head norms): torch (the model's plain ops, several
# kernels each) or one Triton kernel each (k3.kernels.rms_norm, .situ, .attn_res_mix, .head_norms); auto: triton
# where it runs (CUDA with Triton), else torch.
SMALL_OP_KERNELS = ("auto", "torch", "triton")
# Token sampling: torch (k3.rollout.embedded.sampling.sample_next) or flashinfer's top-p kernel (greedy stays argmax);
# auto: flashinfer where it imports on CUDA, else torch.
SAMPLERS = ("auto", "torch", "flashinfer")
# Steps between two checks of "every row has stopped": the loop's only host sync while it decodes.
STOP_CHECK_INTERVAL = 16
# Batch sizes a CUDA graph is captured for; a batch runs in the smallest that holds it (its own size above all).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class DecodeSettings:
    """``mode`` in :data:`DECODE_MODES`, ``mla_kernel`` in :data:`MLA_KERNELS`, ``small_ops`` in
    :data:`SMALL_OP_KERNELS`, ``sampler`` in :data:`SAMPLERS`; ``stop_check_interval`` ≥ 1 (steps);
    ``graph_batch_sizes``: increasing positive batch sizes."""

    mode: str = "auto"
    mla_kernel: str = "auto"
    sampler: str = "auto"
    small_ops: str = "auto"
    stop_check_interval: int = STOP_CHECK_INTERVAL
    graph_batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES

    def __post_init__(self) -> None:
        for name, value, choices in (("mode", self.mode, DECODE_MODES), ("mla_kernel", self.mla_kernel, MLA_KERNELS),
                                     ("sampler", self.sampler, SAMPLERS),
                                     ("small_ops", self.small_ops, SMALL_OP_KERNELS)):
            if value not in choices:
                raise ValueError(f"DecodeSettings.{name}={value!r}: expected one of {', '.join(choices)}")
        if not isinstance(self.stop_check_interval, int) or self.stop_check_interval < 1:
            raise ValueError(f"DecodeSettings.stop_check_interval={self.stop_check_interval!r}: expected an integer "
                             ">= 1 (steps between stop checks)")
        sizes = tuple(self.graph_batch_sizes)
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"DecodeSettings.graph_batch_sizes={self.graph_batch_sizes!r}: expected increasing "
                             "positive batch sizes")
