"""The megatron policy with the recipe's dynamic batch size (``use_dynamic_batch_size``: packed micro-batches
planned by ``k3.megatron.packing``, the recipe's per-sample-mean loss) on CPU (gloo, tests/megatron_compat.py).

Worker ``one`` (one process): the tiny K3 checkpoint of ``test_megatron_policy``; a dynamic-batch policy and the
torch reference model with the same adapters. Its log-probs equal the torch trainer's; its first GRPO step's
loss, diagnostics and gradient norm equal the recipe's loss computed on the reference model (each response's
PPO-clip token mean, averaged over the batch, old log-probs perturbed so that ratios move and some clip); the
micro-batches are the plan's (first-fit count, every trajectory once, packed whole). Worker ``layouts`` (2 ranks):
the same policy under TP2, EP2 × DP2 (the batch balanced over DP ranks), CP2 (each packed trajectory padded to a
multiple of 4 and split per sequence) and PP2 (micro-batches of different lengths through the stages) equals
the one-rank policy: log-probs, step-1 gradients, three steps, the exported adapters.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from layout_parity import trajectories
from tiny_checkpoint import write_tiny_checkpoint

RANK, ALPHA = 4, 8.0
STEPS = 3
MAX_TOKENS = 16  # the trajectories are 3-11 tokens: 3 micro-batches at one rank
LR = 5e-4
LAYOUTS = {"tp2": (2, 1, 1, 1), "ep2xdp2": (1, 2, 1, 1), "cp2": (1, 1, 1, 2), "pp2": (1, 1, 2, 1)}


def _old_log_probs(lp: list[list[float]]) -> list[list[float]]:
    """The current log-probs moved by up to ±0.3 nats (ratios from 0.74 to 1.35: some tokens clip)."""
    return [[x + 0.3 * math.sin(1.7 * i + 0.9 * j) for j, x in enumerate(row)] for i, row in enumerate(lp)]


def _policy(base: Path, parallel=(1, 1, 1, 1)):
    from k3.lora import LoRAConfig
    from k3.rl.grpo import GRPOConfig
    from k3.rl.trainers.megatron import build_megatron_policy
    from k3.settings.parallel import ParallelLayout

    tp, ep, pp, cp = parallel
    layout = ParallelLayout.model_parallel(tp=tp, ep=ep, pp=pp, cp=cp,
                                           first_stage_layers=4 if pp > 1 else None)  # 9 layers: 4 + 5
    return build_megatron_policy(base, LoRAConfig(rank=RANK, alpha=ALPHA), pad_id=0,
                                 grpo=GRPOConfig(lr=LR, weight_decay=0.1, clip_grad=1.0),
                                 max_tokens_per_micro_batch=MAX_TOKENS, seed=3, layout=layout,
                                 use_dynamic_batch_size=True)


def _train(policy, old: list[list[float]]) -> dict:
    from test_megatron_parallel import _all_stages, _with_random_B
    from test_megatron_policy import _chunks

    from k3.megatron.lora import gather_lora, load_lora

    # B values drawn over every stage's factors in name order: the same under every layout, PP included
    load_lora(policy.model, _with_random_B(_all_stages(gather_lora(policy.model))))
    trajs = trajectories(policy.cfg.vocab_size)
    got = {"dp": policy.dp, "lp": policy.log_probs(trajs)}
    # old = the one-rank policy's log-probs: ratios start at 1, so no token sits on a clip boundary where a float32
    # difference between layouts would decide whether its gradient counts (test_megatron_policy's LAYOUT_LR note)
    for t, o in zip(trajs, old or got["lp"]):
        t.old_log_probs = o
    got["old"] = [t.old_log_probs for t in trajs]
    got["steps"] = [policy.train_step(trajs)]
    got["grads"] = _all_stages(gather_lora(policy.model, grads=True))
    got["steps"] += [policy.train_step(trajs) for _ in range(STEPS - 1)]
    got["final"] = _chunks(policy.export_chunks(STEPS, dtype=torch.float32))
    return got


def _recipe_step_on_the_reference(ref, trajs) -> dict:
    """The recipe's loss on the torch reference model: per trajectory the PPO-clip token mean of its response,
    averaged over the trajectories; its diagnostics the same way; the LoRA gradient's global norm."""
    from k3.rl.grpo import is_lora_parameter, policy_loss, token_entropy, token_log_probs

    ref.zero_grad(set_to_none=True)
    total, clip, kl, ent = 0.0, 0.0, 0.0, 0.0
    for t in trajs:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        p, n = len(t.prompt_ids), len(t.response_ids)
        logits = ref(ids)[:, p - 1:p - 1 + n]
        lp = token_log_probs(logits, ids[:, p:])
        pl = policy_loss(lp, torch.tensor([t.old_log_probs]), torch.tensor([t.advantage]), torch.ones(1, n))
        total = total + pl.loss / len(trajs)
        clip += pl.pg_clipfrac.item() / len(trajs)
        kl += pl.ppo_kl.item() / len(trajs)
        ent += token_entropy(logits.detach()).mean().item() / len(trajs)
    total.backward()
    norm = math.sqrt(sum(p.grad.double().square().sum().item() for name, p in ref.named_parameters()
                         if is_lora_parameter(name) and p.grad is not None))
    return {"train/loss": total.item(), "train/pg_clipfrac": clip, "train/ppo_kl": kl, "train/entropy": ent,
            "train/grad_norm": norm}


def _one_worker(root: Path) -> dict:
    import megatron_compat

    megatron_compat.install()
    from test_megatron_policy import _randomize_B

    from k3.lora import LoRAConfig, apply_lora
    from k3.lora.export import load_chunk
    from k3.megatron.packing import first_fit_count
    from k3.model import KimiK3ForCausalLM
    from k3.rl.trainers.torch import PolicyTrainer

    base = write_tiny_checkpoint(root)
    policy = _policy(base)
    _randomize_B(policy)
    ref = apply_lora(KimiK3ForCausalLM.from_pretrained(base, dtype=torch.float32), LoRAConfig(rank=RANK, alpha=ALPHA))
    for chunk in policy.export_chunks(0, dtype=torch.float32):
        load_chunk(ref, chunk)
    trajs = trajectories(ref.config.vocab_size)
    out = {"lp_torch": PolicyTrainer(ref, pad_id=0).log_probs(trajs), "lp_megatron": policy.log_probs(trajs)}
    for t, o in zip(trajs, _old_log_probs(out["lp_torch"])):
        t.old_log_probs = o
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    batches, placed = policy._pack_dynamic(trajs, with_targets=True)
    out["plan"] = {"lengths": lengths, "first_fit": first_fit_count(lengths, MAX_TOKENS),
                   "rows": [tuple(mb.input_ids.shape) for mb in batches],
                   "bounds": [mb.cu_seqlens.tolist() for mb in batches], "placed": placed,
                   "weights": sum(float(mb.extra["weights"].sum()) for mb in batches)}
    out["expected_step"] = _recipe_step_on_the_reference(ref, trajs)
    out["step"] = policy.train_step(trajs)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    policy = _policy(base)
    out["one_rank"] = _train(policy, None)
    policy.close()
    return out


def _layouts_worker(root: Path) -> dict:
    import megatron_compat

    megatron_compat.install()
    import torch.distributed as dist
    from megatron.core import parallel_state

    one = torch.load(root / "one.pt", weights_only=False)["one_rank"]
    out = {}
    for name, parallel in LAYOUTS.items():
        policy = _policy(root / "base", parallel)
        got = _train(policy, one["old"])
        if dist.get_rank() == 0:
            out[name] = got
        parallel_state.destroy_model_parallel()
    dist.barrier()
    return out


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "one":
        torch.save(_one_worker(root), root / "one.pt")
    else:
        import torch.distributed as dist

        result = _layouts_worker(root)
        if dist.get_rank() == 0:
            torch.save(result, root / "layouts.pt")


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def one(tmp_path_factory) -> dict:
    from megatron_compat import run_workers

    root = tmp_path_factory.mktemp("megatron_dynamic_batch")
    run_workers([__file__, "one", str(root)], nproc=1)
    return {"root": root, **torch.load(root / "one.pt", weights_only=False)}


@pytest.fixture(scope="module")
def layouts(one) -> dict:
    from megatron_compat import run_workers

    run_workers([__file__, "layouts", str(one["root"])], nproc=2, timeout=480.0)
    return torch.load(one["root"] / "layouts.pt", weights_only=False)


def test_micro_batches_are_the_recipe_plan(one):
    plan = one["plan"]
    assert len(plan["rows"]) == plan["first_fit"] == 3
    assert sorted(i for where in plan["placed"] for i, _ in where) == list(range(6))  # every trajectory once
    for rows, bounds, where in zip(plan["rows"], plan["bounds"], plan["placed"]):
        assert rows == (1, bounds[-1])  # one packed row
        assert [plan["lengths"][i] for i, _ in where] == [b - a for a, b in zip(bounds, bounds[1:])][:len(where)]
        assert [start for _, start in where] == bounds[:len(where)]  # whole trajectories, back to back
    assert plan["weights"] == pytest.approx(1.0)  # the recipe's loss weights: one per sample, over the batch


def test_log_probs_equal_the_torch_trainer(one):
    diff = max(abs(a - b) for x, y in zip(one["lp_megatron"], one["lp_torch"]) for a, b in zip(x, y))
    assert [len(x) for x in one["lp_megatron"]] == [len(x) for x in one["lp_torch"]]
    # float32, another order; measured 1.05e-5 (the torch trainer pads the six into one [6, 11] batch; megatron's
    # packed and padded log-probs agree to 1e-6)
    assert diff < 3e-5


@pytest.mark.parametrize("key", ["train/loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy",
                                 "train/grad_norm"])
def test_first_step_is_the_recipe_loss_on_the_reference_model(one, key):
    # float32: log-probs 1e-5 apart move the ratios by 1e-5 relative; measured: loss 2.4e-7, grad norm 3.7e-5
    # relative. A wrong normalisation (token mean instead of sample mean) is off by O(1).
    got, want = one["step"][key], one["expected_step"][key]
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (key, got, want)


def test_the_old_log_probs_make_the_loss_clip_and_move(one):
    assert one["expected_step"]["train/pg_clipfrac"] > 0.05
    assert abs(one["expected_step"]["train/loss"]) > 1e-3 and one["expected_step"]["train/grad_norm"] > 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_one_rank(one, layouts, layout):
    got, base = layouts[layout], one["one_rank"]
    assert got["dp"] == (2 if layout == "ep2xdp2" else 1)
    assert max(abs(a - b) for x, y in zip(got["lp"], base["lp"]) for a, b in zip(x, y)) < 1e-4
    assert sorted(got["grads"]) == sorted(base["grads"])
    for name, g in base["grads"].items():
        assert ((got["grads"][name] - g).norm() / g.norm()).item() < 5e-4, name
    for step, (a, b, tol) in enumerate(zip(got["steps"], base["steps"], (1e-4, 2e-2, 2e-2))):
        for key in ("train/loss", "train/ppo_kl", "train/entropy", "train/grad_norm", "train/pg_clipfrac",
                    "train/num_tokens"):
            assert abs(a[key] - b[key]) <= tol * max(1.0, abs(b[key])), (step, key, a[key], b[key])
    for c_got, c_one in zip(got["final"], base["final"]):
        for (name, shape, _, a), (name_one, shape_one, _, b) in zip(c_got[4], c_one[4]):
            assert (name, shape) == (name_one, shape_one)
            assert ((a - b).norm() / b.norm()).item() < 5e-3, (layout, name)
