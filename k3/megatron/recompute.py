"""Activation recompute for K3 on megatron: megatron-core's own, set by ``TransformerConfig``'s ``recompute_*`` fields.

How megatron-core 0.16.1 applies them to K3's custom layers:

- ``full`` (``recompute_method`` ``uniform`` / ``block``, ``recompute_num_layers``): ``TransformerBlock`` runs its
  layers through ``_checkpointed_forward``: ``tensor_parallel.checkpoint`` around chunks of ``n`` layers
  (``uniform``) or around each of the stage's first ``n`` layers (``block``). It calls each layer with the same
  ``(hidden_states, context, packed_seq_params, …)`` as the plain loop, and K3's layer passes its AttnRes bank as
  ``context``, so the bank is a checkpoint input and output like the partial sum and nothing in the layer changes.
  One thing does: megatron's checkpoint is reentrant (an autograd ``Function``), and the gradient of the
  parameters inside a checkpointed chunk flows only if one of the chunk's inputs requires grad. Under LoRA the
  embedding is frozen, so the first stage's decoder input does not; :func:`require_decoder_input_grad` marks it.
- ``selective`` (``recompute_modules``): megatron's stock layers read the list themselves; K3's layers do the same
  through :func:`checkpointed`: ``core_attn`` (MLA's softmax core, KDA's delta-rule core), ``layernorm`` (each
  layer's input and pre-MLP norms), ``mlp`` (the dense MLP), ``moe`` (the whole latent MoE) and
  ``shared_experts`` (the MoE's shared experts). megatron's own validation refuses ``moe_act`` (it needs megatron's
  grouped GEMM experts) and ``mla_up_proj`` (it needs megatron's MLA) for K3's config.

Recompute changes what is held between forward and backward, never the math: the recomputed forward draws the
same random state (megatron restores it) and K3 draws none (no dropout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

__all__ = ["K3_SELECTIVE_MODULES", "Recompute", "checkpointed", "require_decoder_input_grad"]

K3_SELECTIVE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")


@dataclass(frozen=True)
class Recompute:
    """The recompute settings (megatron's names): ``granularity`` None (off), ``full`` or ``selective``;
    ``method`` (``uniform`` / ``block``) and ``num_layers`` (>= 1) for ``full`` only (megatron-core applies
    them to full recompute alone); ``modules`` for ``selective`` (default ``("core_attn",)``, megatron's)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        g, m, n = self.granularity, self.method, self.num_layers
        if g not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity={g!r}: expected None, 'full' or 'selective'")
        if g == "full":
            if m not in ("uniform", "block"):
                raise ValueError(f"recompute_granularity 'full' needs recompute_method 'uniform' or 'block', got {m!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"recompute_granularity 'full' needs recompute_num_layers >= 1, got {n!r}")
        elif m is not None or n is not None:
            raise ValueError(f"recompute_method={m!r}, recompute_num_layers={n!r}: megatron-core applies them to "
                             f"recompute_granularity 'full' only (here {g!r}); leave them unset")
        if self.modules is not None:
            if g != "selective":
                raise ValueError(f"recompute_modules={list(self.modules)}: only for recompute_granularity 'selective'")
            unknown = sorted(set(self.modules) - set(K3_SELECTIVE_MODULES))
            if unknown:
                raise ValueError(f"recompute_modules {unknown}: K3's layers recompute {list(K3_SELECTIVE_MODULES)}")

    def config_fields(self) -> dict:
        """The ``TransformerConfig`` fields these settings set."""
        if self.granularity is None:
            return {}
        fields = {"recompute_granularity": self.granularity, "recompute_method": self.method,
                  "recompute_num_layers": self.num_layers}
        if self.modules is not None:
            fields["recompute_modules"] = list(self.modules)
        return fields

    def check_stages(self, stage_layer_counts: list[int]) -> None:
        """``uniform`` recomputes chunks of ``num_layers`` layers: every pipeline stage's layer count must be a
        multiple of it (megatron would index past the stage's last layer)."""
        if self.method == "uniform" and any(c % self.num_layers for c in stage_layer_counts):
            raise ValueError(f"recompute_method 'uniform' with recompute_num_layers={self.num_layers}: the pipeline "
                             f"stages hold {stage_layer_counts} layers, not all multiples of it")


def checkpointed(config: TransformerConfig, module: str, training: bool, fn: Callable[..., torch.Tensor],
                 *tensors: torch.Tensor | None) -> torch.Tensor:
    """``fn(*tensors)``, recomputed in the backward (megatron's ``tensor_parallel.checkpoint``) when selective
    recompute lists ``module`` and a training forward builds a graph. ``tensors``: the tensor inputs (or None) —
    anything else ``fn`` needs it takes from its closure."""
    if (config.recompute_granularity == "selective" and module in (config.recompute_modules or ()) and training
            and torch.is_grad_enabled()):
        return tensor_parallel.checkpoint(fn, False, *tensors)
    return fn(*tensors)


def require_decoder_input_grad(model: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Make the first stage's decoder input require grad (``model`` a megatron ``GPTModel``), so reentrant
    checkpoints pass the gradient to the adapters inside them (see the module docstring). The embedding stays
    frozen: a tensor made to require grad here has no graph behind it."""

    def mark(_module, _inputs, output):
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_(True)
        return output

    return model.embedding.register_forward_hook(mark)
