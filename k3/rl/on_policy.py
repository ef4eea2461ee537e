"""How far the rollout engine's sampling distribution is from the trainer's policy, per rollout.

GRPO is on-policy: the engine must sample from the adapter the trainer holds. Both score the same sampled tokens,
the engine while generating (its log-probs) and the trainer before its step (its ``old`` log-probs); an engine
that serves another adapter (verl-project/verl#7495, unslothai/unsloth-zoo#1250) shows up as a gap between them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["token_kl"]


def token_kl(engine_logprobs: Sequence[float], trainer_logprobs: Sequence[float]) -> float:
    """Token-level estimate of KL(engine ‖ trainer) in nats per token, over tokens the engine sampled.

    The "k3" estimator (Schulman, "Approximating KL divergence"): with ``d = log p_trainer − log p_engine`` per
    token, ``mean(exp(d) − 1 − d)``; unbiased for tokens drawn from the engine, never negative, zero iff the two
    log-probs agree on every token. Raises ``ValueError`` for sequences of different lengths; 0.0 for none.
    """
    if len(engine_logprobs) != len(trainer_logprobs):
        raise ValueError(f"token_kl: {len(engine_logprobs)} engine log-probs but {len(trainer_logprobs)} trainer "
                         "log-probs: they must score the same tokens")
    if not engine_logprobs:
        return 0.0
    total = 0.0
    for e, t in zip(engine_logprobs, trainer_logprobs):
        d = t - e
        total += math.expm1(d) - d
    return total / len(engine_logprobs)
