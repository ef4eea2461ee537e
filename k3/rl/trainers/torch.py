"""The trainer's side of GRPO on the torch backend: log-probs of rollout tokens and one optimizer step per
global batch, on the LoRA parameters of a ``KimiK3ForCausalLM``.

A trajectory is ``prompt_ids + response_ids``; the model predicts response token ``j`` from position
``len(prompt) + j - 1``. Batches are right-padded (causal models ignore what comes after a token).

``log_probs_chunk_size``: the log-softmax over the vocabulary in chunks of that many tokens
(``k3.rl.trainers.log_probs``), in the log-prob pass and the train step. ``check_for_nan_in_loss_and_grad``: a NaN
or Inf in a micro-batch's loss or in a gradient stops the step before anything is applied, with an error naming
the rank, the optimizer step, the micro-batches and the parameters. Off, a non-finite gradient norm still applies
nothing (and says so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from k3.rl.grpo import GRPOConfig, build_optimizer, policy_loss
from k3.rl.trainers.log_probs import chunked_token_log_probs
from k3.rl.trainers.memory_regions import ParamGrads
from k3.rl.trainers.trajectory import Trajectory
from k3.settings.train import NO_LOG_PROBS_CHUNKING, check_log_probs_chunk_size

__all__ = ["PolicyTrainer", "micro_batches"]


def _pad_batch(trajs: Sequence[Trajectory], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, S], response_mask [B, S-1])``, right-padded; response_mask marks the target positions
    (shifted by one) that hold response tokens."""
    S = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    resp = torch.zeros((B, S - 1), dtype=torch.bool)
    for b, t in enumerate(trajs):
        seq = t.prompt_ids + t.response_ids
        ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        p = len(t.prompt_ids)
        resp[b, p - 1 : p - 1 + len(t.response_ids)] = True
    return ids, resp


def micro_batches(trajs: Sequence[Trajectory], max_tokens: int) -> list[list[Trajectory]]:
    """Split into micro-batches whose padded size (count × longest) stays within ``max_tokens`` (a single
    longer trajectory gets a micro-batch of its own)."""
    out: list[list[Trajectory]] = []
    cur: list[Trajectory] = []
    longest = 0
    for t in trajs:
        n = len(t.prompt_ids) + len(t.response_ids)
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(t)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


class PolicyTrainer:
    """GRPO on a LoRA-carrying model (the base must be frozen; ``build_optimizer`` checks it).

    ``max_tokens_per_micro_batch`` is the recipe's ``max_tokens_per_gpu``; ``clip_grad`` the global-norm clip;
    ``log_probs_chunk_size`` and ``check_for_nan_in_loss_and_grad`` as in the module docstring; ``rank``: the rank
    its errors name.
    """

    def __init__(
        self,
        model: nn.Module,
        pad_id: int,
        grpo: GRPOConfig = GRPOConfig(),
        max_tokens_per_micro_batch: int = 8192,
        device: str | torch.device = "cpu",
        log_probs_chunk_size: int = NO_LOG_PROBS_CHUNKING,
        check_for_nan_in_loss_and_grad: bool = False,
        rank: int = 0,
    ) -> None:
        self.log_probs_chunk_size = check_log_probs_chunk_size(log_probs_chunk_size)
        self.check_for_nan = bool(check_for_nan_in_loss_and_grad)
        self.rank = rank
        self.model = model.to(device)
        self.pad_id = pad_id
        self.grpo = grpo
        self.max_tokens = max_tokens_per_micro_batch
        self.device = torch.device(device)
        self.optimizer = build_optimizer(self.model, grpo)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.steps = 0

    def _logp(self, mb: Sequence[Trajectory], grad: bool,
              with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(log-probs [B, S-1], response mask [B, S-1], entropies [B, S-1] or None)`` of a micro-batch."""
        ids, resp = _pad_batch(mb, self.pad_id)
        ids, resp = ids.to(self.device), resp.to(self.device)
        with torch.set_grad_enabled(grad):
            # right padding needs no mask: a causal model never lets a later (pad) token reach an earlier one
            logits = self.model(ids)
            # The last position predicts nothing: it keeps the logits whole (chunked without a copy) with any id as
            # its target, and its values are dropped.
            targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
            logp, entropy = chunked_token_log_probs(logits, targets, self.log_probs_chunk_size, with_entropy)
        return logp[:, :-1], resp, None if entropy is None else entropy[:, :-1]

    @torch.no_grad()
    def log_probs(self, trajs: Sequence[Trajectory]) -> list[list[float]]:
        """Per-token log-probabilities of each trajectory's response under the current policy (nats)."""
        was = self.model.training
        self.model.eval()
        out: list[list[float]] = []
        for mb in micro_batches(trajs, self.max_tokens):
            logp, resp, _ = self._logp(mb, grad=False)
            for b, t in enumerate(mb):
                out.append(logp[b][resp[b]].tolist())
        self.model.train(was)
        return out

    def train_step(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step over ``trajs`` (a global batch): token-mean PPO-clip loss over all its response
        tokens, gradients accumulated over micro-batches, global-norm clipping, the run's optimizer (AdamW or SGD:
        ``build_optimizer``) on the LoRA factors."""
        if not trajs:
            raise ValueError("train_step needs at least one trajectory")
        for t in trajs:
            if t.old_log_probs is None or len(t.old_log_probs) != len(t.response_ids):
                raise ValueError("every trajectory needs old_log_probs, one per response token")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = sum(len(t.response_ids) for t in trajs)
        sums = {"loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "entropy": 0.0}
        bad_losses: list[tuple[int, float]] = []  # (micro-batch, loss) where the loss is NaN or Inf
        for k, mb in enumerate(micro_batches(trajs, self.max_tokens)):
            logp, resp, entropy = self._logp(mb, grad=True, with_entropy=True)
            old = torch.zeros_like(logp)
            adv = torch.zeros(len(mb), dtype=logp.dtype, device=logp.device)
            for b, t in enumerate(mb):
                old[b][resp[b]] = torch.tensor(t.old_log_probs, dtype=logp.dtype, device=logp.device)
                adv[b] = t.advantage
            out = policy_loss(logp, old, adv, resp, eps_clip=self.grpo.eps_clip,
                              eps_clip_high=self.grpo.eps_clip_high, num_tokens=num_tokens)
            out.loss.backward()
            ent = entropy[resp].sum() / num_tokens
            loss = float(out.loss.detach())
            if not math.isfinite(loss):
                bad_losses.append((k, loss))
            sums["loss"] += loss
            sums["pg_clipfrac"] += float(out.pg_clipfrac)
            sums["ppo_kl"] += float(out.ppo_kl)
            sums["entropy"] += float(ent)
        if self.check_for_nan:
            self._check_finite(bad_losses)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grpo.clip_grad)
        if not math.isfinite(float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {float(grad_norm)} at step {self.steps}: step skipped")
        self.optimizer.step()
        self.steps += 1
        return {
            "train/loss": sums["loss"],
            "train/pg_clipfrac": sums["pg_clipfrac"],
            "train/ppo_kl": sums["ppo_kl"],
            "train/entropy": sums["entropy"],
            "train/grad_norm": float(grad_norm),
            "train/num_tokens": float(num_tokens),
        }

    def _check_finite(self, bad_losses: list[tuple[int, float]]) -> None:
        """``check_for_nan_in_loss_and_grad``: raise ``FloatingPointError`` (nothing applied) when a micro-batch's
        loss or a gradient holds a NaN or Inf, naming this rank, the optimizer step, the micro-batches and the
        parameters (the first three of each kind)."""
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None]
        parts = [f"{what} in the loss of micro-batch{'es' if len(ks) > 1 else ''} {', '.join(map(str, ks))}"
                 for what, ks in (("NaN", [k for k, x in bad_losses if math.isnan(x)]),
                                  ("Inf", [k for k, x in bad_losses if math.isinf(x)])) if ks]
        # A norm is NaN when an element is, Inf when one is (or the squares overflow); one fused pass, one sync.
        norms = torch.stack(torch._foreach_norm([g.detach().float() for _, g in named])) if named else torch.zeros(0)
        flags = torch.stack([torch.isnan(norms), torch.isinf(norms)]).cpu()
        for row, what in ((0, "NaN"), (1, "Inf")):
            bad = [name for (name, _), hit in zip(named, flags[row].tolist()) if hit]
            if bad:
                more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                parts.append(f"{what} in the gradients of {', '.join(bad[:3])}{more}")
        if parts:
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"NaN/Inf at optimizer step {self.steps}, the step was not applied "
                                     f"(check_for_nan_in_loss_and_grad): rank {self.rank}: {'; '.join(parts)}")

    # -- memory (k3.rl.trainers.memory_regions)
    def grad_buffers(self) -> ParamGrads:
        """The adapters' ``.grad`` tensors, for the trainer's sleep (dropped; autograd makes new ones)."""
        return ParamGrads(self.params)
