import math

import pytest
import torch
from torch import nn

from k3.rl.grpo import (
    GRPOConfig,
    build_optimizer,
    group_advantages,
    is_lora_parameter,
    policy_loss,
    token_entropy,
    token_log_probs,
)


def test_group_advantages_closed_form_sample_std():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1])
    adv = group_advantages(rewards, 4)
    s1 = math.sqrt(1 / 3)  # sample std of [1,0,0,1]: sum of squares 1, over n-1 = 3
    s3 = 0.5  # sample std of [0,0,0,1]: (3 * 1/16 + 9/16) / 3 = 1/4
    want = (
        [0.5 / (s1 + 1e-6) * x for x in (1, -1, -1, 1)] + [0.0] * 4 + [v / (s3 + 1e-6) for v in (-0.25,) * 3 + (0.75,)]
    )
    torch.testing.assert_close(adv, torch.tensor(want), rtol=0, atol=1e-6)
    # population std would give exactly +-1 for the first group; the recipe's is the sample std
    assert abs(adv[0].item() - 1.0) > 0.1


def test_group_advantages_variants_and_errors():
    r = torch.tensor([3.0, 1.0])
    torch.testing.assert_close(group_advantages(r, 2, std_normalize=False), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(group_advantages(r, 1), torch.zeros(2))  # one sample: no spread, no signal
    assert group_advantages(torch.tensor([1, 0]), 2).dtype == torch.float32
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


# One token per situation: (ratio, advantage) → which branch PPO-clip takes (eps 0.2 low, 0.28 high).
RATIOS = [1.5, 1.25, 0.5, 1.5, 0.5, 0.9, 1.0, 7.0]
ADVS = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 2.0, 5.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 0]  # the last token is padding
# per-token loss and d loss_i / d logp_i (= -r * A when the unclipped term is taken, 0 when clipped)
LOSS = [-1.28, -1.25, 0.8, 1.5, -0.5, 0.9, -2.0, 0.0]
GRAD = [0.0, -1.25, 0.0, 1.5, -0.5, 0.9, -2.0, 0.0]
CLIPPED = [1, 0, 1, 0, 0, 0, 0, 0]


def _inputs(dtype=torch.float64):
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.7, -0.2, -4.0], dtype=dtype)
    logp = (old + torch.tensor(RATIOS, dtype=dtype).log()).requires_grad_(True)
    return logp, old, torch.tensor(ADVS, dtype=dtype), torch.tensor(MASK)


def test_policy_loss_and_gradient_by_hand():
    logp, old, adv, mask = _inputs()
    out = policy_loss(logp.view(2, 4), old.view(2, 4), adv.view(2, 4), mask.view(2, 4))
    n = sum(MASK)
    assert out.loss.item() == pytest.approx(sum(LOSS) / n, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(GRAD, dtype=torch.float64) / n, rtol=0, atol=1e-12)
    assert out.pg_clipfrac.item() == pytest.approx(sum(CLIPPED) / n)
    want_kl = -sum(math.log(r) for r, m in zip(RATIOS, MASK, strict=True) if m) / n
    assert out.ppo_kl.item() == pytest.approx(want_kl, abs=1e-12)
    assert set(out.metrics()) == {"pg_loss", "pg_clipfrac", "ppo_kl"}


def test_high_clip_is_asymmetric():
    # ratio 1.25 with A > 0 is inside the 0.28 high clip but outside a symmetric 0.2 one.
    logp, old, adv, mask = _inputs()
    sym = policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.2)
    sym.loss.backward()
    assert logp.grad[1].item() == 0.0
    assert sym.pg_clipfrac.item() == pytest.approx(3 / 7)
    logp.grad = None
    asym = policy_loss(logp, old, adv, mask)
    asym.loss.backward()
    assert logp.grad[1].item() == pytest.approx(-1.25 / 7)


def test_on_policy_gradient_is_minus_advantage():
    # At ratio 1 the clip is inactive: d loss / d logp = -A / N exactly (plain policy gradient).
    old = torch.randn(3, 5, dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    policy_loss(logp, old, adv, mask).loss.backward()
    want = (-adv[:, None].expand(3, 5) * mask) / mask.sum()
    torch.testing.assert_close(logp.grad, want, rtol=0, atol=1e-12)


def test_token_mean_over_the_global_batch_with_micro_batches():
    torch.manual_seed(0)
    old = torch.randn(4, 6, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(4, 6, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(4, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0], [1] + [0] * 5])
    full = policy_loss(logp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full.loss, logp)
    n = int(mask.sum())
    parts = [
        policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], num_tokens=n) for i in (0, 2)
    ]
    total = parts[0].loss + parts[1].loss
    (g_parts,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.loss.item(), abs=1e-12)
    torch.testing.assert_close(g_parts, g_full, rtol=0, atol=1e-12)
    # padded tokens get exactly zero gradient, and a token mean is not a mean of per-sample means
    assert (g_full[mask == 0] == 0).all()
    per_sample = torch.stack([(policy_loss(logp[i], old[i], adv[i].expand(6), mask[i]).loss) for i in range(4)])
    assert abs(per_sample.mean().item() - full.loss.item()) > 1e-3


def test_token_weights_give_the_per_sample_mean_of_the_recipe():
    torch.manual_seed(1)
    old = torch.randn(4, 6, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(4, 6, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(4, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0], [1] + [0] * 5])
    weights = mask.double() / (mask.sum(1, keepdim=True) * 4)  # each sample's token mean, averaged over the 4 samples
    got = policy_loss(logp, old, adv, mask, token_weights=weights)
    (g_got,) = torch.autograd.grad(got.loss, logp)
    per_sample = [policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1]) for i in range(4)]
    want = sum(p.loss for p in per_sample) / 4
    (g_want,) = torch.autograd.grad(want, logp)
    assert got.loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)
    assert got.pg_clipfrac.item() == pytest.approx(sum(p.pg_clipfrac.item() for p in per_sample) / 4, abs=1e-12)
    assert got.ppo_kl.item() == pytest.approx(sum(p.ppo_kl.item() for p in per_sample) / 4, abs=1e-12)
    # uniform weights 1/N are the token mean
    uniform = policy_loss(logp, old, adv, mask, token_weights=mask.double() / mask.sum())
    assert uniform.loss.item() == pytest.approx(policy_loss(logp, old, adv, mask).loss.item(), abs=1e-12)
    with pytest.raises(ValueError, match="replaces num_tokens"):
        policy_loss(logp, old, adv, mask, token_weights=weights, num_tokens=10)
    with pytest.raises(ValueError, match="token_weights"):
        policy_loss(logp, old, adv, mask, token_weights=weights[:, :3])


def test_masked_garbage_cannot_poison_the_loss():
    logp = torch.tensor([[-1.0, float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("nan")]])
    adv = torch.tensor([[1.0, float("nan")]])
    out = policy_loss(logp, old, adv, torch.tensor([[1, 0]]))
    out.loss.backward()
    assert out.loss.item() == -1.0 and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0
    empty = policy_loss(logp.detach(), old, adv, torch.zeros(1, 2))
    assert empty.loss.item() == 0.0


def test_policy_loss_rejects_mismatched_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="eps_clip"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3), eps_clip=1.5)


def test_token_log_probs_and_entropy_against_reference():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 11, dtype=torch.bfloat16)
    targets = torch.randint(0, 11, (2, 3))
    ref = torch.distributions.Categorical(logits=logits.float())
    torch.testing.assert_close(token_log_probs(logits, targets), ref.log_prob(targets), rtol=0, atol=1e-6)
    torch.testing.assert_close(token_entropy(logits), ref.entropy(), rtol=0, atol=1e-6)
    assert token_entropy(torch.zeros(4, 8)).allclose(torch.full((4,), math.log(8)))
    with pytest.raises(ValueError, match="line up"):
        token_log_probs(logits, targets[:, :2])


class TinyLoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(3, 2)
        self.base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(3, 1, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(1, 2, bias=False)})


def test_lora_name_rule():
    assert is_lora_parameter("language_model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert is_lora_parameter("layers.3.mlp.experts.lora_B_shared")
    assert is_lora_parameter("model.layers.1.mlp.experts.w1_lora_A")  # k3.lora's shared-outer expert factors
    assert is_lora_parameter("model.layers.1.self_attn.q_proj.lora_B")
    assert not is_lora_parameter("layers.0.self_attn.q_proj.weight")
    assert not is_lora_parameter("layers.0.flora_A.weight")


def test_build_optimizer_settings_and_one_adamw_step():
    torch.manual_seed(0)
    m = TinyLoRA().double()
    opt = build_optimizer(m)
    assert isinstance(opt, torch.optim.AdamW)
    (group,) = opt.param_groups
    assert group["lr"] == 1e-5 and group["betas"] == (0.9, 0.98) and group["weight_decay"] == 0.1
    assert group["eps"] == 1e-8
    params = [m.lora_A["default"].weight, m.lora_B["default"].weight]
    assert [id(p) for p in group["params"]] == [id(p) for p in params]
    before = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    cfg = GRPOConfig()
    for p0, g, p in zip(before, grads, params, strict=True):
        # first Adam step: m_hat = g, v_hat = g^2; decay is decoupled (applied to p, not added to g)
        want = p0 * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * g / (g.abs() + cfg.adam_eps)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-15)
        coupled = p0 - cfg.lr * (g + 0.1 * p0) / ((g + 0.1 * p0).abs() + cfg.adam_eps)
        assert not torch.allclose(p.detach(), coupled, rtol=0, atol=1e-12)


def test_build_optimizer_no_decay_for_1d():
    p2, p1 = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    opt = build_optimizer([("x.lora_A.weight", p2), ("x.lora_magnitude", p1)])
    assert [(g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(0.1, 1), (0.0, 1)]


def test_build_optimizer_refusals():
    m = TinyLoRA()
    m.base.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="only LoRA parameters.*base.weight"):
        build_optimizer(m)
    m = TinyLoRA()
    m.lora_B["default"].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="LoRA parameters are frozen"):
        build_optimizer(m)
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError, match="frozen.*a.lora_A"):
        build_optimizer([("a.lora_A", frozen)])
    with pytest.raises(TypeError, match="named_parameters"):
        build_optimizer([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="no LoRA parameters"):
        build_optimizer(nn.Linear(2, 2).requires_grad_(False))
    p = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="listed twice"):
        build_optimizer([("a.lora_A", p), ("b.lora_A", p)])
