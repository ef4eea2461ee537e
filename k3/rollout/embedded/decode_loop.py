"""One batch's generation loop, on the device: sample, record, check stops every N steps, step the model.

Per step nothing comes back to the host: the sampled tokens and their logprobs go into preallocated device tensors
``[batch, max_new_tokens]``, a device-side ``done`` mask and each row's first stop step are updated in place, and
the next step starts from the sampled tokens. Every ``stop_check_interval`` steps one host sync asks whether every
row has stopped; at the end one transfer brings the results back, and each row is cut after its first stop token.

The results equal the per-token loop's (the engine before issue #21): every row keeps being fed its own sampled
token after it stopped (so the batch the model sees is the same), and a seeded generator is put back to its state
right after the step where the last row stopped — the steps run past it until the next check drew from it, and the
next batch of the same ``generate`` call must start from the same state as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from k3.rollout.embedded.sampling import Sampler, sample_next
from k3.rollout.protocol import SamplingParams

__all__ = ["DecodeResult", "Stepper", "decode_batch"]


class Stepper(Protocol):
    """How the model runs for one batch: the prompt, then one token per row at a time."""

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ids``, ``mask [batch, prompt]`` (left-padded, on the device) -> next-token logits ``[batch, vocab]``."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [batch]`` int64 -> next-token logits ``[batch, vocab]``."""
        ...


@dataclass
class DecodeResult:
    """Per row: the response tokens (the stop token included), their logprobs, ``"stop"`` or ``"length"``."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]


def decode_batch(stepper: Stepper, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingParams,
                 stop_ids: torch.Tensor, generator: torch.Generator | None, stop_check_interval: int,
                 sampler: Sampler = sample_next) -> DecodeResult:
    """Generate up to ``sampling.max_new_tokens`` tokens for every row of ``ids``.

    Args:
        stepper: the model for this batch. ids, mask: ``[batch, prompt]`` on the model's device.
        stop_ids: ``[n]`` int64 on the device: tokens that end a row (eos and the request's stop tokens).
        generator: the seeded generator (on the device) or None; shared with the next batch of the call.
        stop_check_interval: steps between host checks of "every row stopped" (≥ 1).
        sampler: ``sample_next`` or an equivalent (``k3.rollout.embedded.sampling``).
    """
    B, device = ids.shape[0], ids.device
    M = sampling.max_new_tokens
    tokens = torch.empty(B, M, dtype=torch.int64, device=device)
    logprobs = torch.empty(B, M, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    first_stop = torch.full((B,), M, dtype=torch.int64, device=device)  # M: never stopped
    # The generator's state after each of the last N steps: a host copy (no device sync), to rewind to.
    rewind = generator is not None and sampling.temperature > 0
    states: list[torch.Tensor | None] = [None] * stop_check_interval

    logits = stepper.prefill(ids, mask)
    steps = 0
    for step in range(M):
        tok, lp = sampler(logits, sampling.temperature, sampling.top_p, generator)
        if rewind:
            states[step % stop_check_interval] = generator.get_state()
        tokens[:, step] = tok
        logprobs[:, step] = lp
        hit = torch.isin(tok, stop_ids) & ~done
        first_stop.masked_fill_(hit, step)
        done |= hit
        steps = step + 1
        if steps == M or (steps % stop_check_interval == 0 and bool(done.all())):
            break
        logits = stepper.step(tok)

    first = first_stop.tolist()
    rows_tokens, rows_logprobs = tokens[:, :steps].tolist(), logprobs[:, :steps].tolist()
    last = max(first)
    if rewind and last < steps - 1:  # every row stopped before the end: give back the draws made after
        generator.set_state(states[last % stop_check_interval])
    out = DecodeResult([], [], [])
    for b in range(B):
        n = first[b] + 1 if first[b] < M else steps
        out.tokens.append(rows_tokens[b][:n])
        out.logprobs.append(rows_logprobs[b][:n])
        out.finish_reasons.append("stop" if first[b] < M else "length")
    return out
