"""GRPO as the recipe runs it: group-normalised advantages, asymmetric PPO-clip, AdamW on LoRA parameters.

Facts from the public recipe (miles ``--advantage-estimator grpo --kl-loss-coef 0 --entropy-coef 0
--eps-clip 0.2 --eps-clip-high 0.28``; Megatron optimizer defaults):

- Advantages: each prompt's ``n`` samples are centred on their mean and divided by ``std + 1e-6``, where std
  is the *sample* standard deviation (Bessel-corrected, ``torch.std``'s default, as miles computes it). One
  sample per prompt has no spread: its advantage is 0 (the sample std would be NaN).
- Loss: per token, ``max(-r·A, -clip(r, 1 - 0.2, 1 + 0.28)·A)`` with ``r = exp(logp - logp_old)``; averaged
  over the response tokens of the global batch (loss mask); no KL term, no reference model, no entropy bonus.
- Optimizer, normal mode: Megatron's Adam with ``decoupled_weight_decay=True`` (its default, and required by the
  recipe's ``--optimizer-cpu-offload``), i.e. AdamW: lr 1e-5 constant, betas (0.9, 0.98), eps 1e-8, weight decay
  0.1; Megatron exempts 1-D parameters and biases from decay. debug_minimal: torch's SGD (the recipe's: TE's
  FusedSGD would allocate a momentum buffer even at momentum 0), momentum 0, lr 1e-6, weight decay 0; torch's SGD
  adds weight decay to the gradient (L2), as megatron's does. Gradients are clipped at global norm 1.0
  (Megatron's ``--clip-grad`` default; the recipe does not change it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from k3.settings.train import (keep_hyperparameters, optimizer_kind_problem, optimizer_options_problem,
                               restore_hyperparameters)


@dataclass(frozen=True)
class GRPOConfig:
    """The recipe's GRPO and optimizer settings (the defaults: normal mode). ``optimizer``: ``adam`` or ``sgd``
    (``k3.settings.train.OPTIMIZERS``); ``betas`` and ``adam_eps`` apply to Adam, ``sgd_momentum`` to SGD."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    std_eps: float = 1e-6
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    optimizer: str = "adam"
    sgd_momentum: float = 0.0

    def __post_init__(self) -> None:
        problem = optimizer_options_problem(False, False, 0.0, self.optimizer, self.sgd_momentum)
        if problem is not None:
            raise ValueError(problem)


def group_advantages(
    rewards: torch.Tensor, n_samples_per_prompt: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages from rewards laid out prompt-major.

    rewards: [num_prompts * n_samples_per_prompt] (samples of one prompt contiguous). Returns the same shape,
    float32: ``(r - mean_group) / (std_group + eps)`` with the sample std, or just centred without
    ``std_normalize``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    if n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of n_samples_per_prompt={n_samples_per_prompt}"
        )
    groups = rewards.float().reshape(-1, n_samples_per_prompt)
    centred = groups - groups.mean(dim=-1, keepdim=True)
    if std_normalize and n_samples_per_prompt > 1:
        centred = centred / (groups.std(dim=-1, keepdim=True) + eps)
    return centred.reshape(-1)


@dataclass
class PolicyLoss:
    """The scalar to backpropagate and detached token-mean diagnostics (miles' names)."""

    loss: torch.Tensor  # [] — sum of masked per-token losses / num_tokens
    pg_loss: torch.Tensor  # [] detached, same value as loss
    pg_clipfrac: torch.Tensor  # [] fraction of response tokens where the clipped term was taken
    ppo_kl: torch.Tensor  # [] mean of (logp_old - logp): the k1 estimate of KL(old || new)

    def metrics(self) -> dict[str, float]:
        return {"pg_loss": self.pg_loss.item(), "pg_clipfrac": self.pg_clipfrac.item(), "ppo_kl": self.ppo_kl.item()}


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    num_tokens: int | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """Asymmetric PPO-clip loss, token-level mean.

    log_probs, old_log_probs, loss_mask: [batch, resp_len] (or any matching shape, e.g. packed [tokens]);
    advantages: the same shape, or [batch] to broadcast over each sample's tokens. ``num_tokens`` is the
    number of response tokens in the *global* batch: pass it when the batch is split into micro-batches so
    their gradients add up to the global token mean; by default this call's ``loss_mask.sum()`` is used.
    ``token_weights`` (same shape, 0 off the mask) replaces ``1 / num_tokens`` per token: the loss and the
    diagnostics are ``Σ w·x`` (e.g. the recipe's per-sample mean, ``k3.megatron.packing.sample_mean_weights``).
    """
    if log_probs.shape != old_log_probs.shape or log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must have the same shape"
        )
    if advantages.shape != log_probs.shape:
        if advantages.dim() == 1 and log_probs.dim() == 2 and advantages.shape[0] == log_probs.shape[0]:
            advantages = advantages.unsqueeze(-1)
        else:
            raise ValueError(
                f"advantages {tuple(advantages.shape)} must match log_probs {tuple(log_probs.shape)} or be "
                "[batch] for [batch, resp_len] log_probs"
            )
    if not 0 <= eps_clip < 1 or eps_clip_high < 0:
        raise ValueError(f"need 0 <= eps_clip < 1 and eps_clip_high >= 0, got {eps_clip}, {eps_clip_high}")
    keep = loss_mask.bool()
    # Masked positions (padding, prompt) are zeroed before use so garbage there cannot leak NaN into the grad.
    advantages = torch.where(keep, advantages.detach().to(log_probs.dtype).expand_as(log_probs), 0.0)
    log_ratio = torch.where(keep, log_probs - old_log_probs.detach(), 0.0)
    ratio = log_ratio.exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    per_token = torch.where(keep, torch.maximum(unclipped, clipped), 0.0)
    if token_weights is not None:
        if token_weights.shape != log_probs.shape or num_tokens is not None:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} must match log_probs "
                             f"{tuple(log_probs.shape)}, and replaces num_tokens (pass one of them)")
        w = torch.where(keep, token_weights.detach().to(log_probs.dtype), 0.0)
        loss = (per_token * w).sum()
        with torch.no_grad():
            clipfrac = (((clipped > unclipped) & keep).to(log_probs.dtype) * w).sum()
            kl = -(log_ratio * w).sum()
        return PolicyLoss(loss=loss, pg_loss=loss.detach(), pg_clipfrac=clipfrac, ppo_kl=kl)
    if num_tokens is None:
        denom = keep.sum().to(log_probs.dtype)
    else:
        denom = torch.as_tensor(num_tokens, dtype=log_probs.dtype, device=log_probs.device)
    denom = denom.clamp_min(1)  # an all-masked micro-batch contributes 0, not NaN
    loss = per_token.sum() / denom
    with torch.no_grad():
        clipfrac = ((clipped > unclipped) & keep).sum().to(log_probs.dtype) / denom
        kl = -log_ratio.sum() / denom
    return PolicyLoss(loss=loss, pg_loss=loss.detach(), pg_clipfrac=clipfrac, ppo_kl=kl)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, in float32. logits: [..., vocab]; targets: [...] ids. Returns [...]."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not line up")
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position, nats, float32. logits: [..., vocab] → [...]."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


_LORA_NAME = re.compile(r"(^|[._])lora_[A-Za-z0-9]")


def is_lora_parameter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor: ``...q_proj.lora_A`` (PEFT-style ``lora_A.weight`` too) or an
    expert factor such as ``...experts.w1_lora_A``."""
    return _LORA_NAME.search(name) is not None


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" … ({len(names)} in all)" if len(names) > 5 else "")


def build_optimizer(
    params: nn.Module | Iterable[tuple[str, nn.Parameter]], config: GRPOConfig = GRPOConfig()
) -> torch.optim.Optimizer:
    """``config.optimizer`` over the LoRA parameters, with the recipe's settings: ``torch.optim.AdamW`` (lr, betas,
    eps, decoupled weight decay) or ``torch.optim.SGD`` (lr, ``sgd_momentum``, L2 weight decay; no dampening, no
    Nesterov: megatron's SGD). Either way 1-D parameters and biases get no weight decay (megatron's groups).

    ``params`` is a model (its trainable parameters are taken) or ``(name, parameter)`` pairs. Refused: a
    trainable parameter that is not LoRA (the base must be frozen), a frozen LoRA parameter, a parameter
    listed twice, none at all, and bare tensors without names (LoRA-only cannot be checked without them).
    """
    if isinstance(params, nn.Module):
        named = list(params.named_parameters())
        frozen_lora = [n for n, p in named if is_lora_parameter(n) and not p.requires_grad]
        if frozen_lora:
            raise ValueError(f"LoRA parameters are frozen: {_some(frozen_lora)}")
        named = [(n, p) for n, p in named if p.requires_grad]
    else:
        named = list(params)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(
                    "build_optimizer needs a model or (name, parameter) pairs such as model.named_parameters(); "
                    f"got {type(item).__name__}"
                )
        frozen = [n for n, p in named if not p.requires_grad]
        if frozen:
            raise ValueError(f"parameters do not require grad (frozen): {_some(frozen)}")
    not_lora = [n for n, _ in named if not is_lora_parameter(n)]
    if not_lora:
        raise ValueError(
            f"only LoRA parameters may be trained, but these are trainable: {_some(not_lora)}; freeze the base "
            "model (apply_lora does) before building the optimizer"
        )
    if not named:
        raise ValueError("no LoRA parameters to optimize; apply LoRA to the model first")
    seen: set[int] = set()
    for n, p in named:
        if id(p) in seen:
            raise ValueError(f"parameter {n} is listed twice")
        seen.add(id(p))
    # Megatron's default: no weight decay on biases and 1-D parameters.
    no_decay = [p for n, p in named if p.dim() <= 1 or n.endswith(".bias")]
    decay = [p for n, p in named if not (p.dim() <= 1 or n.endswith(".bias"))]
    groups = [{"params": decay, "weight_decay": config.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"`` or ``"adam"``: which of ``build_optimizer``'s optimizers ``optimizer`` is (the tag of its saved
    state)."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    raise TypeError(f"{type(optimizer).__name__} is not an optimizer build_optimizer makes (AdamW or SGD)")


def load_torch_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], saved_kind: str) -> None:
    """Load a torch optimizer's ``state_dict()`` saved by a ``saved_kind`` optimizer (``"adam"`` / ``"sgd"``) into
    ``optimizer``, keeping the run's hyperparameters (``k3.settings.train.keep_hyperparameters``); a state of the
    other kind raises ``ValueError`` (one line) before anything is loaded."""
    problem = optimizer_kind_problem(saved_kind, optimizer_kind(optimizer))
    if problem is not None:
        raise ValueError(problem)
    kept = keep_hyperparameters(optimizer.param_groups)
    optimizer.load_state_dict(dict(state))
    restore_hyperparameters(optimizer.param_groups, kept)
