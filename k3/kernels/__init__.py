"""Backend dispatch for the hot kernels: torch references on CPU, fla (KDA) on CUDA."""

from k3.kernels.grouped_mm import grouped_mm, grouped_mm_reference
from k3.kernels.kda import fla_available, kda_core
from k3.kernels.kda_chunk import chunk_kda
from k3.kernels.kda_naive import naive_recurrent_kda

__all__ = ["grouped_mm", "grouped_mm_reference", "kda_core", "fla_available", "chunk_kda", "naive_recurrent_kda"]
