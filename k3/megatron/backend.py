"""The guard of ``k3 train --backend megatron``: the megatron trainer is the GPU scale path."""

from __future__ import annotations

__all__ = ["MegatronBackendUnavailable", "require_cuda"]


class MegatronBackendUnavailable(RuntimeError):
    """``--backend megatron`` was asked for on a machine that cannot run it."""


def require_cuda() -> None:
    """Return if CUDA is usable; otherwise raise at once with a message that says so and names ``--backend torch``.

    The megatron backend trains with NCCL on CUDA devices (fla's KDA kernels, grouped GEMMs); on a CPU-only
    machine the pure-PyTorch backend runs the same recipe.
    """
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a core dependency
        raise MegatronBackendUnavailable(f"--backend megatron needs PyTorch with CUDA ({e}); "
                                         "use --backend torch") from e
    if not torch.cuda.is_available():
        build = "a CPU-only build of PyTorch" if torch.version.cuda is None else "no visible CUDA device"
        raise MegatronBackendUnavailable(
            f"--backend megatron needs a CUDA GPU, and this machine has {build} "
            f"(torch {torch.__version__}). Use --backend torch to train on this machine.")
