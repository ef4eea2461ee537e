"""``log_probs_chunk_size`` and ``check_for_nan_in_loss_and_grad`` on the torch backend.

The chunked log-softmax (``k3.rl.trainers.log_probs``) equals the one-pass reference (``k3.rl.grpo``) in values and
gradients at chunk sizes 1, 7 and larger than the tokens, makes its float32 ``[tokens, vocab]`` temporaries one
chunk at a time and, with gradients, keeps none of them for the backward; ``PolicyTrainer`` gives the same log-probs
and the same GRPO step with chunks as without. A NaN or Inf in a loss or a gradient stops the step naming the rank,
the optimizer step, the micro-batch and the parameter; with the check off the check does not run.
"""

from __future__ import annotations

import pytest
import torch
from tiny_lora_model import tiny_lora_model
from torch.utils._python_dispatch import TorchDispatchMode

from k3.rl.grpo import token_entropy, token_log_probs
from k3.rl.trainers.log_probs import chunked_token_log_probs
from k3.rl.trainers.torch import PolicyTrainer
from k3.rl.trainers.trajectory import Trajectory
from k3.settings.train import TrainingSettings

VOCAB = 50


def _logits(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 11, VOCAB, generator=gen)).to(dtype)
    targets = torch.randint(0, VOCAB, (3, 11), generator=gen)
    weight = torch.randn(3, 11, generator=gen)
    return logits, targets, weight


@pytest.mark.parametrize("size", [1, 7, 33, 1000])
def test_chunks_equal_the_one_pass_reference_in_values_and_gradients(size):
    logits, targets, weight = _logits()
    ref_x = logits.clone().requires_grad_(True)
    ref_lp = token_log_probs(ref_x, targets)
    (ref_lp * weight).sum().backward()
    x = logits.clone().requires_grad_(True)
    lp, ent = chunked_token_log_probs(x, targets, size, with_entropy=True)
    (lp * weight).sum().backward()
    # each token's log-softmax reads its own row only: the same float32 operations
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-6) and lp.shape == targets.shape
    assert torch.allclose(ent, token_entropy(logits), rtol=0, atol=1e-6) and not ent.requires_grad
    assert torch.allclose(x.grad, ref_x.grad, rtol=0, atol=1e-7)
    with torch.no_grad():
        lp_ng, ent_ng = chunked_token_log_probs(logits, targets, size)
    assert ent_ng is None and torch.equal(lp_ng, lp.detach())


class _Largest(TorchDispatchMode):
    """The largest float32 tensor with the vocabulary as its last dim that any op makes."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if _vocab_f32(t):
                self.numel = max(self.numel, t.numel())
        return result


def _vocab_f32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() > 0 and t.shape[-1] == VOCAB


@pytest.mark.parametrize("size", [-1, 1, 7, 1000])
def test_float32_temporaries_exist_one_chunk_at_a_time(size):
    """BF16 logits (as on the GPU), so every float32 [..., vocab] tensor is a temporary of the log-softmax."""
    logits, targets, weight = _logits(torch.bfloat16)
    tokens = targets.numel()
    saved = [0]

    def pack(t):
        if _vocab_f32(t):
            saved[0] = max(saved[0], t.numel())
        return t

    x = logits.clone().requires_grad_(True)
    with _Largest() as seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = chunked_token_log_probs(x, targets, size, with_entropy=True)
        (lp * weight).sum().backward()
    with _Largest() as seen_no_grad, torch.no_grad():
        chunked_token_log_probs(logits, targets, size, with_entropy=True)
    if size == -1:
        assert (seen.numel, seen_no_grad.numel, saved[0]) == (tokens * VOCAB,) * 3
    else:
        one = min(size, tokens) * VOCAB
        assert (seen.numel, seen_no_grad.numel) == (one, one)
        assert saved[0] == 0  # checkpointed: autograd keeps the BF16 logits only, recomputes a chunk at a time


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, None])
def test_bad_chunk_sizes_are_refused(bad):
    logits, targets, _ = _logits()
    with pytest.raises(ValueError, match=r"log_probs_chunk_size=.*expected tokens per chunk \(an integer >= 1\), "
                                         r"or -1 for no chunking"):
        chunked_token_log_probs(logits, targets, bad)
    with pytest.raises(ValueError, match="log_probs_chunk_size"):
        TrainingSettings(num_steps_per_rollout=1, use_dynamic_batch_size=True, log_probs_chunk_size=bad,
                         recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                         check_for_nan_in_loss_and_grad=True, save="/tmp/x")
    with pytest.raises(ValueError, match="log_probs_chunk_size"):
        PolicyTrainer(tiny_lora_model(), pad_id=0, log_probs_chunk_size=bad)


def test_mismatched_shapes_are_refused():
    logits, targets, _ = _logits()
    with pytest.raises(ValueError, match=r"logits \(3, 11, 50\) and targets \(3, 10\) do not line up"):
        chunked_token_log_probs(logits, targets[:, 1:], 7)


# ---------------------------------------------------------------------------------------------- the trainer
def _trajs(vocab: int) -> list[Trajectory]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for k, adv in enumerate((1.0, -0.5, 0.7, -1.2)):
        p, n = 2 + k % 3, 2 + (3 * k) % 5
        ids = torch.randint(3, vocab, (p + n,), generator=gen).tolist()
        out.append(Trajectory(ids[:p], ids[p:], adv))
    return out


def _trainer(**kwargs) -> PolicyTrainer:
    return PolicyTrainer(tiny_lora_model(), pad_id=0, max_tokens_per_micro_batch=16, **kwargs)


def _lora(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_policy_trainer_with_chunks_equals_one_pass():
    whole, chunked = _trainer(), _trainer(log_probs_chunk_size=7)
    trajs = _trajs(whole.model.config.vocab_size)
    lp = whole.log_probs(trajs)
    got = chunked.log_probs(trajs)
    assert [len(x) for x in got] == [len(x) for x in lp]
    assert [v for x in got for v in x] == pytest.approx([v for x in lp for v in x], abs=1e-6)
    for t, x in zip(trajs, lp):
        t.old_log_probs = x
    a, b = whole.train_step(trajs), chunked.train_step(trajs)
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert a["train/grad_norm"] > 0
    before, after = _lora(whole), _lora(chunked)
    for name, p in before.items():
        assert torch.allclose(after[name], p, rtol=1e-5, atol=1e-7), name


def _with_old(trainer, trajs):
    for t, x in zip(trajs, trainer.log_probs(trajs)):
        t.old_log_probs = x
    return trajs


def test_a_nan_advantage_stops_the_step_naming_rank_step_and_micro_batch():
    trainer = _trainer(check_for_nan_in_loss_and_grad=True, rank=3)
    trajs = _with_old(trainer, _trajs(trainer.model.config.vocab_size))
    trainer.train_step(trajs)
    kept = _lora(trainer)
    trajs[3] = Trajectory(trajs[3].prompt_ids, trajs[3].response_ids, float("nan"), trajs[3].old_log_probs)
    with pytest.raises(FloatingPointError) as e:
        trainer.train_step(trajs)
    msg = str(e.value)
    assert msg.startswith("NaN/Inf at optimizer step 1, the step was not applied (check_for_nan_in_loss_and_grad): "
                          "rank 3: NaN in the loss of micro-batch 1; NaN in the gradients of "), msg
    assert trainer.steps == 1 and all(torch.equal(kept[n], p) for n, p in _lora(trainer).items())


def test_an_inf_gradient_is_named_with_its_parameter():
    trainer = _trainer(check_for_nan_in_loss_and_grad=True)
    trajs = _with_old(trainer, _trajs(trainer.model.config.vocab_size))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    param.register_hook(lambda g: torch.full_like(g, float("inf")))
    with pytest.raises(FloatingPointError, match=rf"optimizer step 0, .*rank 0: Inf in the gradients of {name}$"):
        trainer.train_step(trajs)


def test_with_the_check_off_it_does_not_run(monkeypatch):
    trainer = _trainer(check_for_nan_in_loss_and_grad=False)
    trajs = _with_old(trainer, _trajs(trainer.model.config.vocab_size))
    ran = []
    monkeypatch.setattr(PolicyTrainer, "_check_finite", lambda self, bad: ran.append(bad))
    trainer.train_step(trajs)
    trajs[0] = Trajectory(trajs[0].prompt_ids, trajs[0].response_ids, float("nan"), trajs[0].old_log_probs)
    # the trainer's own guard still never applies a non-finite update
    with pytest.raises(FloatingPointError, match="gradient norm is nan at step 1: step skipped"):
        trainer.train_step(trajs)
    assert ran == []
    on = _trainer(check_for_nan_in_loss_and_grad=True)
    on.train_step(_with_old(on, _trajs(on.model.config.vocab_size)))
    assert ran == [[]]  # on: it runs every step (and found nothing)
