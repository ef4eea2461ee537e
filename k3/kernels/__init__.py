"""The hot kernels, one folder per op with the naive form beside the fast one (as fla keeps them).

- ``kda/``: the KDA delta-rule core: ``naive`` (per-token recurrence, the oracle), ``chunk`` (torch chunked form,
  the CPU default), ``gate`` (K3's gate in torch), ``fla`` (the dispatch: fla's Triton kernels on CUDA, else
  torch), ``tuning`` (fla's autotune results pinned per GPU, recorded under ``fla_tuned/``).
- ``mxfp4/``: ``codec`` (numpy/torch MXFP4 encode and decode, the reference) and ``triton`` (the GPU decoder).
- ``expert_lora/``: shared-outer LoRA on the routed experts' grouped GEMMs: ``reference`` (plain torch),
  ``triton`` (the rank-r kernels), ``schedule`` (their row tiles), ``availability`` (where Triton runs),
  ``function`` (the autograd functions and the kernel choice the model and Megatron call), ``folded`` (the
  adapter folded into the base GEMMs: measured slower, kept as a comparison).
- ``grouped_mm``: grouped GEMM of expert-sorted rows (torch's native kernel, a padded fallback, the reference).

Kernels are leaves: nothing here imports another part of k3. This file imports nothing, so importing one op
(the converter's workers import ``mxfp4.codec`` without torch) loads only that op.
"""
