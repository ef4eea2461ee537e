"""The trainer's side of GRPO on the torch backend: log-probs of rollout tokens and one optimizer step per
global batch, on the LoRA parameters of a ``KimiK3ForCausalLM``.

A trajectory is ``prompt_ids + response_ids``; the model predicts response token ``j`` from position
``len(prompt) + j - 1``. Batches are right-padded (causal models ignore what comes after a token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from k3.rl.grpo import GRPOConfig, build_optimizer, policy_loss, token_entropy, token_log_probs
from k3.rl.trainers.memory_regions import ParamGrads
from k3.rl.trainers.trajectory import Trajectory

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

    ``max_tokens_per_micro_batch`` is the recipe's ``max_tokens_per_gpu``; ``clip_grad`` the global-norm clip.
    """

    def __init__(
        self,
        model: nn.Module,
        pad_id: int,
        grpo: GRPOConfig = GRPOConfig(),
        max_tokens_per_micro_batch: int = 8192,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model.to(device)
        self.pad_id = pad_id
        self.grpo = grpo
        self.max_tokens = max_tokens_per_micro_batch
        self.device = torch.device(device)
        self.optimizer = build_optimizer(self.model, grpo)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.steps = 0

    def _logp(self, mb: Sequence[Trajectory], grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, resp = _pad_batch(mb, self.pad_id)
        ids, resp = ids.to(self.device), resp.to(self.device)
        with torch.set_grad_enabled(grad):
            # right padding needs no mask: a causal model never lets a later (pad) token reach an earlier one
            logits = self.model(ids)[:, :-1]
            logp = token_log_probs(logits, ids[:, 1:])
        return logp, resp, logits

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
        tokens, gradients accumulated over micro-batches, global-norm clipping, AdamW on the LoRA factors."""
        if not trajs:
            raise ValueError("train_step needs at least one trajectory")
        for t in trajs:
            if t.old_log_probs is None or len(t.old_log_probs) != len(t.response_ids):
                raise ValueError("every trajectory needs old_log_probs, one per response token")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = sum(len(t.response_ids) for t in trajs)
        sums = {"loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "entropy": 0.0}
        for mb in micro_batches(trajs, self.max_tokens):
            logp, resp, logits = self._logp(mb, grad=True)
            old = torch.zeros_like(logp)
            adv = torch.zeros(len(mb), dtype=logp.dtype, device=logp.device)
            for b, t in enumerate(mb):
                old[b][resp[b]] = torch.tensor(t.old_log_probs, dtype=logp.dtype, device=logp.device)
                adv[b] = t.advantage
            out = policy_loss(logp, old, adv, resp, eps_clip=self.grpo.eps_clip,
                              eps_clip_high=self.grpo.eps_clip_high, num_tokens=num_tokens)
            out.loss.backward()
            with torch.no_grad():
                ent = token_entropy(logits)[resp].sum() / num_tokens
            sums["loss"] += float(out.loss.detach())
            sums["pg_clipfrac"] += float(out.pg_clipfrac)
            sums["ppo_kl"] += float(out.ppo_kl)
            sums["entropy"] += float(ent)
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

    # -- memory (k3.rl.trainers.memory_regions)
    def grad_buffers(self) -> ParamGrads:
        """The adapters' ``.grad`` tensors, for the trainer's sleep (dropped; autograd makes new ones)."""
        return ParamGrads(self.params)
