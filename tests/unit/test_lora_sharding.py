"""Sharding rules (§4.2): layouts, exact shard/gather round trips, and the gradient sums proven numerically
by simulating the TP/EP ranks in one process against the unsharded computation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.lora.experts import LoRALatentExperts
from k3.lora.sharding import (ParallelLayout, ShardingError, factor_rule, factor_rules, gather, grad_sum_group,
                              local_shape, shard)
from k3.model.mlp import situ
from k3.model.moe import LatentExperts


def test_rule_table_is_the_recipes():
    L = ParallelLayout(tp=4, ep=8, sequence_parallel=True)
    split = {f: (r.split_dim, r.split_group) for f, r in factor_rules().items() if not r.replicated}
    assert split == {"o_lora_A": (1, "tp"), "fc1_lora_B": (0, "tp"), "fc2_lora_A": (1, "tp"),
                     "w1_lora_B": (0, "ep"), "w3_lora_B": (0, "ep"), "w2_lora_A": (0, "ep")}
    sums = {f: grad_sum_group(f, L) for f in factor_rules() if grad_sum_group(f, L)}
    assert sums == {"fc1_lora_A": "tp", "fc2_lora_B": "tp", "w1_lora_A": "ep", "w3_lora_A": "ep", "w2_lora_B": "ep",
                    "q_a_lora_A": "tp", "q_a_lora_B": "tp", "kv_a_lora_A": "tp", "kv_a_lora_B": "tp"}
    assert grad_sum_group("fc2_lora_B", ParallelLayout(tp=4)) is None  # only with sequence parallelism
    assert factor_rule("fc1_lora_B").halves


def test_recipe_per_rank_count_tp32_ep64():
    """The AG run (TP32/EP64, r=32, no shared-expert adapters) reported 447,167,488 trainable parameters per
    rank; the local shapes of the rule table reproduce it exactly."""
    L, r = ParallelLayout(tp=32, ep=64), 32

    def n(factor, shape):
        return math.prod(local_shape(factor, shape, L))

    attention = n("o_lora_A", (r, 12288)) + n("o_lora_B", (7168, r))
    mla = (n("q_a_lora_A", (r, 7168)) + n("q_a_lora_B", (1536, r)) + n("kv_a_lora_A", (r, 7168))
           + n("kv_a_lora_B", (576, r)))
    dense = (n("fc1_lora_A", (r, 7168)) + n("fc1_lora_B", (2 * 33792, r)) + n("fc2_lora_A", (r, 33792))
             + n("fc2_lora_B", (7168, r)))
    routed = (2 * n("w1_lora_A", (r, 3584)) + 2 * n("w1_lora_B", (896, 3072, r)) + n("w2_lora_A", (896, r, 3072))
              + n("w2_lora_B", (3584, r)))
    assert 93 * attention + 24 * mla + dense + 92 * routed == 447_167_488
    assert local_shape("w1_lora_B", (896, 3072, r), L) == (14, 3072, r)


@settings(max_examples=60, deadline=None)
@given(factor=st.sampled_from(sorted(factor_rules())), tp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def test_shard_then_gather_is_exact(factor, tp, ep, seed):
    g = torch.Generator().manual_seed(seed)
    rule = factor_rule(factor)
    # the split dim is 8: divisible by every group size here, and by 2·TP for fc1 B's two halves
    shape = {None: [3, 5], 0: [8, 3, 5] if rule.split_group == "ep" else [8, 3], 1: [3, 8]}[rule.split_dim]
    full = torch.randn(*shape, generator=g)
    layout = ParallelLayout(tp=tp, ep=ep)
    n = 1 if rule.replicated else layout.size(rule.split_group)
    pieces = [shard(full, factor, layout, k) for k in range(n)]
    assert all(tuple(p.shape) == local_shape(factor, shape, layout) for p in pieces)
    assert torch.equal(gather(pieces, factor), full)


def test_fc1_B_shards_keep_gate_and_up_halves():
    gate, up = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    fused = torch.cat([gate, up])
    piece = shard(fused, "fc1_lora_B", ParallelLayout(tp=4), rank=1)
    assert torch.equal(piece, torch.cat([gate[2:4], up[2:4]]))  # local = [gate_t; up_t]


@pytest.mark.parametrize("call, match", [
    (lambda: ParallelLayout(tp=2, etp=2), "ETP = 1"),
    (lambda: ParallelLayout(tp=0), "tp=0"),
    (lambda: factor_rule("q_lora_A"), "unknown LoRA factor"),
    (lambda: local_shape("o_lora_A", (4, 10), ParallelLayout(tp=4)), r"dim 1 \(10\).*TP=4"),
    (lambda: local_shape("fc1_lora_B", (12, 4), ParallelLayout(tp=4)), r"each half \(6\).*TP=4"),
    (lambda: local_shape("w2_lora_A", (6, 4, 3), ParallelLayout(ep=4)), "EP=4"),
    (lambda: shard(torch.zeros(4, 8), "o_lora_A", ParallelLayout(tp=2), rank=2), "rank 2 outside"),
    (lambda: gather([torch.zeros(2), torch.ones(2)], "q_a_lora_A"), "rank 1 differs"),
    (lambda: gather([], "q_a_lora_A"), "no shards"),
])
def test_bad_layouts_raise(call, match):
    with pytest.raises(ShardingError, match=match):
        call()


# ---------------------------------------------------------------------- gradient rules, simulated
def _grads(loss, params):
    return torch.autograd.grad(loss, params)


def test_fc1_A_gradient_is_summed_over_tp():
    """Column-parallel fc1: rank t holds [gate_t; up_t] of W and B; its A gradient sees only its columns."""
    torch.manual_seed(0)
    N, H, F, r, tp = 6, 10, 8, 3, 4
    layout = ParallelLayout(tp=tp)
    x, cot = torch.randn(N, H), torch.randn(N, H)
    Wg, Wu, Wd = torch.randn(F, H), torch.randn(F, H), torch.randn(H, F)
    A, B = torch.randn(r, H, requires_grad=True), torch.randn(2 * F, r, requires_grad=True)

    def mlp(A, B, Wg, Wu, Wd):
        Bg, Bu = B.chunk(2)
        g, u = x @ Wg.T + (x @ A.T) @ Bg.T, x @ Wu.T + (x @ A.T) @ Bu.T
        return situ(g, u) @ Wd.T

    gA, gB = _grads((mlp(A, B, Wg, Wu, Wd) * cot).sum(), [A, B])
    rank_A, rank_B = [], []
    for t in range(tp):
        At = A.detach().clone().requires_grad_()
        Bt = shard(B.detach(), "fc1_lora_B", layout, t).requires_grad_()
        rows = slice(t * F // tp, (t + 1) * F // tp)
        partial = mlp(At, Bt, Wg[rows], Wu[rows], Wd[:, rows])  # the all-reduce of fc2 sums these
        a, b = _grads((partial * cot).sum(), [At, Bt])
        rank_A.append(a), rank_B.append(b)
    torch.testing.assert_close(sum(rank_A), gA)
    assert not torch.allclose(rank_A[0], gA)  # one rank alone is wrong: the sum is needed
    torch.testing.assert_close(gather(rank_B, "fc1_lora_B"), gB)  # B: local grads are the full grad's shards


@pytest.mark.parametrize("prefix", ["q_a", "kv_a"])
def test_q_a_and_kv_a_gradients_are_summed_over_tp(prefix):
    """MLA's duplicated q_a (kv_a alike): every TP rank holds the whole W_a and its adapter, the output goes
    through the (replicated) norm into the column-parallel q_b, whose rows t feed the row-parallel o_proj's
    columns t. Each rank back-propagates only its q_b rows' part of the gradient, so A's and B's gradients are
    per-rank shares: summed over TP they are the full gradients, one rank alone is not."""
    torch.manual_seed(4)
    N, H, Q, P, r, tp = 6, 10, 8, 12, 3, 4
    x, cot = torch.randn(N, H), torch.randn(N, H)
    Wa, Wb, Wo, norm_w = torch.randn(Q, H), torch.randn(P, Q), torch.randn(H, P), torch.rand(Q) + 0.5
    A, B = torch.randn(r, H, requires_grad=True), torch.randn(Q, r, requires_grad=True)

    def attn(A, B, Wb, Wo):
        q = x @ Wa.T + (x @ A.T) @ B.T  # the duplicated q_a with its adapter
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
        return (q @ Wb.T) @ Wo.T  # column-parallel q_b, then (after attention) row-parallel o_proj

    gA, gB = _grads((attn(A, B, Wb, Wo) * cot).sum(), [A, B])
    rank_A, rank_B = [], []
    for t in range(tp):
        At, Bt = A.detach().clone().requires_grad_(), B.detach().clone().requires_grad_()
        rows = slice(t * P // tp, (t + 1) * P // tp)
        a, b = _grads((attn(At, Bt, Wb[rows], Wo[:, rows]) * cot).sum(), [At, Bt])  # o_proj's all-reduce sums
        rank_A.append(a), rank_B.append(b)
    torch.testing.assert_close(sum(rank_A), gA)
    torch.testing.assert_close(sum(rank_B), gB)
    assert not torch.allclose(rank_A[0], gA) and not torch.allclose(rank_B[0], gB)
    layout = ParallelLayout(tp=tp)
    assert grad_sum_group(f"{prefix}_lora_A", layout) == grad_sum_group(f"{prefix}_lora_B", layout) == "tp"
    assert factor_rule(f"{prefix}_lora_A").replicated and factor_rule(f"{prefix}_lora_B").replicated


@pytest.mark.parametrize("sp", [True, False])
def test_fc2_B_gradient_is_summed_over_tp_only_with_sp(sp):
    """Row-parallel fc2: rank t computes h_t·A_tᵀ, the partials are summed over TP, then B. Without SP the
    sum is an all-reduce (backward: identity) and every rank runs B on all rows; with SP it is a
    reduce-scatter (backward: all-gather) and rank t runs B on its sequence shard only."""
    torch.manual_seed(1)
    N, H, F, r, tp = 8, 6, 12, 2, 4
    layout = ParallelLayout(tp=tp, sequence_parallel=sp)
    h, cot = torch.randn(N, F), torch.randn(N, H)
    A, B = torch.randn(r, F, requires_grad=True), torch.randn(H, r, requires_grad=True)
    gA, gB = _grads((((h @ A.T) @ B.T) * cot).sum(), [A, B])
    cols = [slice(t * F // tp, (t + 1) * F // tp) for t in range(tp)]
    As = [shard(A.detach(), "fc2_lora_A", layout, t).requires_grad_() for t in range(tp)]
    Bs = [B.detach().clone().requires_grad_() for _ in range(tp)]
    if sp:  # one graph: the reduce-scatter's backward hands every rank the gradient of all rows
        z = sum(h[:, cols[k]] @ As[k].T for k in range(tp))
        rows = [slice(t * N // tp, (t + 1) * N // tp) for t in range(tp)]
        loss = sum(((z[rows[t]] @ Bs[t].T) * cot[rows[t]]).sum() for t in range(tp))
        grads = _grads(loss, As + Bs)
        rank_A, rank_B = list(grads[:tp]), list(grads[tp:])
    else:  # per rank: the all-reduce's backward is the identity, the other ranks' partials are constants
        rank_A, rank_B = [], []
        for t in range(tp):
            z = sum(h[:, cols[k]] @ (As[k] if k == t else As[k].detach()).T for k in range(tp))
            a, b = _grads(((z @ Bs[t].T) * cot).sum(), [As[t], Bs[t]])
            rank_A.append(a), rank_B.append(b)
    if sp:
        torch.testing.assert_close(sum(rank_B), gB)
        assert not torch.allclose(rank_B[0], gB)
    else:
        for b in rank_B:  # every rank already has the full gradient; summing would count it TP times
            torch.testing.assert_close(b, gB)
    assert grad_sum_group("fc2_lora_B", layout) == ("tp" if sp else None)
    torch.testing.assert_close(gather(rank_A, "fc2_lora_A"), gA)  # A: local grads are shards, no sum


def test_o_proj_A_sharded_B_replicated_need_no_sum():
    torch.manual_seed(2)
    N, P, H, r, tp = 5, 12, 7, 3, 3
    layout = ParallelLayout(tp=tp)
    x, cot = torch.randn(N, P), torch.randn(N, H)
    A, B = torch.randn(r, P, requires_grad=True), torch.randn(H, r, requires_grad=True)
    gA, gB = _grads((((x @ A.T) @ B.T) * cot).sum(), [A, B])
    pieces = [shard(A.detach(), "o_lora_A", layout, t) for t in range(tp)]
    rank_A, rank_B = [], []
    for t in range(tp):
        At, Bt = pieces[t].clone().requires_grad_(), B.detach().clone().requires_grad_()
        cols = slice(t * P // tp, (t + 1) * P // tp)
        z = x[:, cols] @ At.T + sum(x[:, slice(k * P // tp, (k + 1) * P // tp)] @ pieces[k].T
                                    for k in range(tp) if k != t)  # all-reduce over TP
        a, b = _grads(((z @ Bt.T) * cot).sum(), [At, Bt])
        rank_A.append(a), rank_B.append(b)
    torch.testing.assert_close(gather(rank_A, "o_lora_A"), gA)
    for b in rank_B:
        torch.testing.assert_close(b, gB)


def test_expert_shared_factors_are_summed_over_ep():
    """EP rank k holds experts [k·E/EP, (k+1)·E/EP) and their tokens: the shared A (gate/up) and shared B
    (down) see only those tokens, so their gradients are summed over EP; per-expert factors are not."""
    torch.manual_seed(3)
    E, Lt, Fi, r, ep = 8, 8, 4, 4, 4
    layout = ParallelLayout(ep=ep)
    base = LatentExperts(E, Lt, Fi, 4.0, 25.0)
    with torch.no_grad():
        for w in (base.w1, base.w2, base.w3):
            w.normal_(std=0.3)
    full = LoRALatentExperts(base, r, 2 * r)
    with torch.no_grad():
        for n in full.factor_names():
            getattr(full, n).normal_(std=0.3)
    counts = torch.tensor([2, 1, 3, 0, 2, 2, 1, 3])
    x = torch.randn(int(counts.sum()), Lt)
    cot = torch.randn(x.shape[0], Lt)
    names = full.factor_names()
    want = dict(zip(names, _grads((full(x, counts) * cot).sum(), [getattr(full, n) for n in names])))
    El = E // ep
    per_rank: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    for k in range(ep):
        local_base = LatentExperts(El, Lt, Fi, 4.0, 25.0)
        with torch.no_grad():
            for w in ("w1", "w2", "w3"):
                getattr(local_base, w).copy_(getattr(base, w)[k * El:(k + 1) * El])
        local = LoRALatentExperts(local_base, r, 2 * r)
        with torch.no_grad():
            for n in names:
                getattr(local, n).copy_(shard(getattr(full, n).detach(), n, layout, k))
        rows = slice(int(starts[k * El]), int(starts[(k + 1) * El]))
        got = _grads((local(x[rows], counts[k * El:(k + 1) * El]) * cot[rows]).sum(),
                     [getattr(local, n) for n in names])
        for n, gr in zip(names, got):
            per_rank[n].append(gr)
    for n in names:
        if grad_sum_group(n, layout) == "ep":
            torch.testing.assert_close(sum(per_rank[n]), want[n], msg=n)
        else:
            torch.testing.assert_close(gather(per_rank[n], n), want[n], msg=n)
