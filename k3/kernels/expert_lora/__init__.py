"""Shared-outer LoRA on the routed experts' grouped GEMMs: ``reference`` (plain torch) beside ``triton`` (the
rank-r kernels, on the row tiles of ``schedule``, where ``availability`` says Triton runs), ``function`` (the
autograd functions and the ``auto|torch|triton`` choice) and ``folded`` (measured slower, a comparison)."""
