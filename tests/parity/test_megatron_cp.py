"""Context parallelism (and the remaining PP checks) of the megatron backend on CPU (gloo, tests/megatron_compat.py).

Two worker runs (this file executed as a script), results compared here:
- one process: TP1 = PP1 = CP1, the baseline (``test_megatron_parallel``'s harness);
- one 4-rank torchrun that first checks the CP primitives of ``k3.megatron.context_parallel`` at CP4 (first,
  middle and last ranks of the chain) against the whole-sequence computation — the KDA state chain, the conv
  halos, the all-gathered causal MLA attention, forward and every input gradient — and then trains tiny K3
  under CP2 (× DP2), TP2 × CP2 (the recipe's TP × CP with sequence parallelism), PP2 × CP2 and PP2 × TP2:
  logits (whole models), forward-only log-probs, losses and LoRA gradients over 3 Adam steps equal the
  baseline's.

In-process checks: the load-balanced split helpers, AttnRes mixing needs no CP exchange, the AttnRes bank's
pack/unpack round trip across a stage boundary is exact with gradients, the 93-layer PP split of the full model
through megatron's own layer counting for PP ∈ {1, 2, 4, 8, 16} (from the launcher's layout), and the errors.
"""

from __future__ import annotations

import sys

import pytest
import torch
from layout_parity import assert_adapters_equal, assert_gradients_equal, assert_losses_equal, rel

# name -> (tp, ep, pp, cp); run on 4 ranks (cp2 is CP2 x DP2)
LAYOUTS = {"cp2": (1, 1, 1, 2), "tp2xcp2": (2, 1, 1, 2), "pp2xcp2": (1, 1, 2, 2), "pp2xtp2": (2, 1, 2, 1)}
STEPS = 3
PRIMITIVE_CP = 4
# packed sequences at CP4: multiples of 2·4 tokens, each of the 8 chunks at least the conv halo (3 tokens)
PACKED_LENGTHS = (24, 40, 32)


# ---------------------------------------------------------------------------------------------- the workers
def _primitive_inputs(s: int = 32, d: int = 8, device: str = "cpu", b: int = 2):
    """Whole-sequence inputs of the CP primitives, identical on every rank (fixed seed): ``b`` rows of ``s`` tokens,
    2 heads of KDA head dim ``d``."""
    from k3.model.kda import CausalConv1d, l2_normalize

    gen = torch.Generator().manual_seed(3)
    h = 2

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    kda = {"q": l2_normalize(rnd(b, s, h, d)), "k": l2_normalize(rnd(b, s, h, d)), "v": rnd(b, s, h, d),
           "g": -5.0 * torch.sigmoid(rnd(b, s, h, d)), "beta": torch.sigmoid(rnd(b, s, h))}
    convs = [CausalConv1d(6, 4).to(device), CausalConv1d(10, 4).to(device)]
    for conv in convs:
        conv.weight.data.copy_(rnd(*conv.weight.shape))
    conv_in = [rnd(b, s, 6), rnd(b, s, 10)]
    attn = {"q": rnd(b, h, s, 12), "k": rnd(b, h, s, 12), "v": rnd(b, h, s, 8)}
    weights = {"kda": rnd(b, s, h, d), "conv": [rnd(b, s, 6), rnd(b, s, 10)], "attn": rnd(b, h, s, 8)}
    return kda, convs, conv_in, attn, weights


def _grads_of(loss_fn, inputs: list[torch.Tensor], params: list[torch.Tensor] = ()):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = loss_fn(*leaves)
    (out[1] if isinstance(out, tuple) else out).backward()
    return out, [t.grad for t in leaves], [p.grad.clone() for p in params]


def _check_primitives(cp: int = PRIMITIVE_CP, s: int = 32, d: int = 8, device: str = "cpu",
                      kda_backends: tuple[tuple[str, str], ...] = (("torch", "torch_chunk"),)) -> dict:
    """Every CP primitive on this rank's tokens == the whole-sequence computation's slice (max rel. error over
    the ranks). ``kda_backends``: pairs (``cp_kda_core`` backend, ``kda_core`` backend of the reference)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from k3.kernels.kda.fla import kda_core
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.context_parallel import (
        cp_causal_attention,
        cp_causal_conv,
        cp_kda_core,
        cp_local_tokens,
        merge_cp_shards,
    )
    from k3.megatron.mla import causal_attention
    from k3.megatron.parallel import init_parallel

    init_parallel(ParallelLayout.model_parallel(cp=cp))
    group = parallel_state.get_context_parallel_group()
    kda, convs, conv_in, attn, w = _primitive_inputs(s, d, device)
    errs: dict[str, float] = {}

    def local(t, dim=1):
        return cp_local_tokens(t, group, dim)

    # KDA core: the state chain (forward states, backward state gradients)
    names = ["q", "k", "v", "g", "beta"]
    for cp_backend, ref_backend in kda_backends:
        tag = "kda" if cp_backend == "torch" and device == "cpu" else f"kda_{cp_backend}"
        full_o, full_g, _ = _grads_of(
            lambda *x, rb=ref_backend: (o := kda_core(*x, scale=0.3, backend=rb)[0], (o * w["kda"]).sum()),
            [kda[n] for n in names])
        cp_o, cp_g, _ = _grads_of(
            lambda *x, cb=cp_backend: (o := cp_kda_core(*x, 0.3, group, backend=cb), (o * local(w["kda"])).sum()),
            [local(kda[n]) for n in names])
        errs[f"{tag}_out"] = rel(cp_o[0], local(full_o[0]))
        for n, a, b in zip(names, cp_g, full_g):
            errs[f"{tag}_grad_{n}"] = rel(a, local(b))
        # the local outputs of all ranks reassemble the whole sequence
        pieces = [torch.empty_like(cp_o[0]) for _ in range(group.size())]
        dist.all_gather(pieces, cp_o[0].detach().contiguous(), group=group)
        errs[f"{tag}_merged"] = rel(merge_cp_shards(pieces, 1), full_o[0])

    # short convs with halos (two inputs, one exchange); weight gradients are per-rank shares: sum them
    def conv_loss(convs_in, outs, ws):
        return sum((y * wt).sum() for y, wt in zip(outs, ws))

    params = [c.weight for c in convs]
    full_y, full_gx, full_gw = _grads_of(
        lambda *x: (ys := [c(xi, None)[0] for c, xi in zip(convs, x)], conv_loss(x, ys, w["conv"])), conv_in, params)
    for p in params:
        p.grad = None
    cp_y, cp_gx, cp_gw = _grads_of(
        lambda *x: (ys := cp_causal_conv(list(x), convs, group), conv_loss(x, ys, [local(t) for t in w["conv"]])),
        [local(t) for t in conv_in], params)
    for i in range(2):
        errs[f"conv_out_{i}"] = rel(cp_y[0][i], local(full_y[0][i]))
        errs[f"conv_grad_x_{i}"] = rel(cp_gx[i], local(full_gx[i]))
        dist.all_reduce(cp_gw[i], group=group)
        errs[f"conv_grad_w_{i}"] = rel(cp_gw[i], full_gw[i])

    # MLA core: all-gathered K/V with the global causal mask ([batch, heads, seq, dim]: seq on dim 2)
    names = ["q", "k", "v"]
    full_a, full_ga, _ = _grads_of(lambda *x: (o := causal_attention(*x, 0.25), (o * w["attn"]).sum()),
                                   [attn[n] for n in names])
    cp_a, cp_ga, _ = _grads_of(lambda *x: (o := cp_causal_attention(*x, 0.25, group), (o * local(w["attn"], 2)).sum()),
                               [local(attn[n], 2) for n in names])
    errs["attn_out"] = rel(cp_a[0], local(full_a[0], 2))
    for n, a, b in zip(names, cp_ga, full_ga):
        errs[f"attn_grad_{n}"] = rel(a, local(b, 2))
    parallel_state.destroy_model_parallel()
    worst = [None] * dist.get_world_size()
    dist.all_gather_object(worst, errs)
    return {k: max(e[k] for e in worst) for k in errs}


def _check_packed_primitives(cp: int = PRIMITIVE_CP, lengths: tuple[int, ...] = PACKED_LENGTHS, d: int = 8,
                             device: str = "cpu",
                             kda_backends: tuple[tuple[str, str], ...] = (("torch", "torch_chunk"),)) -> dict:
    """The CP primitives on packed sequences (``cu_seqlens``: the whole sequences' bounds; each sequence split over
    the ranks on its own) == the whole-stream packed computation (``kda_core`` / ``packed_causal_conv`` /
    ``packed_causal_attention`` with the same bounds), forward and every input gradient; max rel. error over the
    ranks."""
    import itertools

    import torch.distributed as dist
    from megatron.core import parallel_state

    from k3.kernels.kda.fla import kda_core
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.context_parallel import (
        cp_causal_attention,
        cp_causal_conv,
        cp_kda_core,
        cp_local_tokens,
        merge_cp_shards,
    )
    from k3.megatron.packed import packed_causal_attention, packed_causal_conv
    from k3.megatron.parallel import init_parallel

    init_parallel(ParallelLayout.model_parallel(cp=cp))
    group = parallel_state.get_context_parallel_group()
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    kda, convs, conv_in, attn, w = _primitive_inputs(int(cu[-1]), d, device, b=1)
    errs: dict[str, float] = {}

    def local(t, dim=1):
        return cp_local_tokens(t, group, dim, cu_seqlens=cu)

    names = ["q", "k", "v", "g", "beta"]
    for cp_backend, ref_backend in kda_backends:
        tag = "kda" if cp_backend == "torch" and device == "cpu" else f"kda_{cp_backend}"
        full_o, full_g, _ = _grads_of(
            lambda *x, rb=ref_backend: (o := kda_core(*x, scale=0.3, backend=rb, cu_seqlens=cu)[0],
                                        (o * w["kda"]).sum()),
            [kda[n] for n in names])
        cp_o, cp_g, _ = _grads_of(
            lambda *x, cb=cp_backend: (o := cp_kda_core(*x, 0.3, group, backend=cb, cu_seqlens=cu),
                                       (o * local(w["kda"])).sum()),
            [local(kda[n]) for n in names])
        errs[f"{tag}_out"] = rel(cp_o[0], local(full_o[0]))
        for n, a, b in zip(names, cp_g, full_g):
            errs[f"{tag}_grad_{n}"] = rel(a, local(b))
        pieces = [torch.empty_like(cp_o[0]) for _ in range(group.size())]
        dist.all_gather(pieces, cp_o[0].detach().contiguous(), group=group)
        errs[f"{tag}_merged"] = rel(merge_cp_shards(pieces, 1, cu), full_o[0])

    def conv_loss(outs, ws):
        return sum((y * wt).sum() for y, wt in zip(outs, ws))

    params = [c.weight for c in convs]
    full_y, full_gx, full_gw = _grads_of(
        lambda *x: (ys := [packed_causal_conv(xi, c, cu) for c, xi in zip(convs, x)], conv_loss(ys, w["conv"])),
        conv_in, params)
    for p in params:
        p.grad = None
    cp_y, cp_gx, cp_gw = _grads_of(
        lambda *x: (ys := cp_causal_conv(list(x), convs, group, cu), conv_loss(ys, [local(t) for t in w["conv"]])),
        [local(t) for t in conv_in], params)
    for i in range(2):
        errs[f"conv_out_{i}"] = rel(cp_y[0][i], local(full_y[0][i]))
        errs[f"conv_grad_x_{i}"] = rel(cp_gx[i], local(full_gx[i]))
        dist.all_reduce(cp_gw[i], group=group)
        errs[f"conv_grad_w_{i}"] = rel(cp_gw[i], full_gw[i])

    names = ["q", "k", "v"]
    full_a, full_ga, _ = _grads_of(
        lambda *x: (o := packed_causal_attention(*x, 0.25, cu, backend="sequences"), (o * w["attn"]).sum()),
        [attn[n] for n in names])
    cp_a, cp_ga, _ = _grads_of(
        lambda *x: (o := cp_causal_attention(*x, 0.25, group, cu_seqlens=cu), (o * local(w["attn"], 2)).sum()),
        [local(attn[n], 2) for n in names])
    errs["attn_out"] = rel(cp_a[0], local(full_a[0], 2))
    for n, a, b in zip(names, cp_ga, full_ga):
        errs[f"attn_grad_{n}"] = rel(a, local(b, 2))
    parallel_state.destroy_model_parallel()
    worst = [None] * dist.get_world_size()
    dist.all_gather_object(worst, errs)
    return {k: max(e[k] for e in worst) for k in errs}


def _worker(mode: str, out_path: str) -> None:
    import torch.distributed as dist

    if mode != "gpu":  # CPU: megatron on gloo through the test-only shim
        import megatron_compat

        megatron_compat.install()
    import test_megatron_parallel as harness

    if mode in ("gpu", "gpu_packed"):  # 2 GPUs over NCCL: fla's CP kernels and the torch chain / halos / gathers
        backends = (("fla", "fla"), ("torch", "torch_chunk"))
        if mode == "gpu":
            results = {"primitives": _check_primitives(cp=2, s=256, d=64, device="cuda", kda_backends=backends)}
        else:
            results = {"packed_primitives": _check_packed_primitives(cp=2, lengths=(64, 128, 52, 12), d=64,
                                                                     device="cuda", kda_backends=backends)}
        if dist.get_rank() == 0:
            torch.save(results, out_path)
        dist.barrier()
        return
    cfg, ref, batches = harness._reference_and_data()
    if mode == "tp1":
        results = {"tp1": harness._run_layout(1, 1, 1, cfg, ref, batches)}
    else:
        results = {"primitives": _check_primitives(), "packed_primitives": _check_packed_primitives()}
        for name, (tp, ep, pp, cp) in LAYOUTS.items():
            results[name] = harness._run_layout(tp, ep, pp, cfg, ref, batches, cp=cp)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------------------------------------- multi-rank tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megatron_compat import run_workers

    tmp = tmp_path_factory.mktemp("megatron_cp")
    run_workers([__file__, "tp1", str(tmp / "tp1.pt")], nproc=1)
    run_workers([__file__, "layouts", str(tmp / "layouts.pt")], nproc=4, timeout=420.0)
    return {**torch.load(tmp / "tp1.pt"), **torch.load(tmp / "layouts.pt")}


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
def test_cp4_primitives_equal_the_whole_sequence(results):
    # float32: a different summation order (per-chunk cores, masked vs causal attention); a lost or doubled
    # state / halo / gradient message is off by O(1)
    errs = results["primitives"]
    assert len(errs) == 17  # 7 KDA, 6 conv, 4 attention checks
    for name, err in errs.items():
        assert err < 2e-5, (name, err)


@pytest.mark.gpu
def test_cp2_primitives_on_two_gpus_fla_and_torch_chain(tmp_path):
    """On 2 CUDA GPUs (NCCL): fla 0.6.0's CP ``chunk_kda`` on the zigzag layout == fla's whole-sequence
    ``chunk_kda`` (outputs and input gradients; both TF32), and the torch state chain, halos and K/V gathers
    over NCCL == the whole-sequence torch computation."""
    from megatron_compat import run_workers

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    run_workers([__file__, "gpu", str(tmp_path / "gpu.pt")], nproc=2, timeout=420.0)
    errs = torch.load(tmp_path / "gpu.pt")["primitives"]
    print({k: f"{v:.2e}" for k, v in errs.items()})
    assert len(errs) == 24  # 7 fla, 7 torch-chain, 6 conv, 4 attention checks
    for name, err in errs.items():
        # fla's chunk matmuls run in TF32 (k3.kernels.kda.fla: chunk_kda vs torch 6e-4 outputs, 2e-3 state)
        assert err < (1e-2 if name.startswith("kda_fla") else 1e-4), (name, err)


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
def test_cp4_packed_primitives_equal_the_whole_stream(results):
    # each packed sequence split over the 4 ranks on its own: the per-sequence state chain, halos and gathers
    errs = results["packed_primitives"]
    assert len(errs) == 17  # 7 KDA, 6 conv, 4 attention checks
    for name, err in errs.items():
        assert err < 2e-5, (name, err)


@pytest.mark.gpu
def test_cp2_packed_primitives_on_two_gpus_fla_and_torch_chain(tmp_path):
    """On 2 CUDA GPUs (NCCL): packed sequences under CP2 — fla's CP ``chunk_kda`` one sequence at a time and the
    torch chain with one state per sequence == the whole stream's packed computation (fla varlen / torch)."""
    from megatron_compat import run_workers

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    run_workers([__file__, "gpu_packed", str(tmp_path / "gpu.pt")], nproc=2, timeout=420.0)
    errs = torch.load(tmp_path / "gpu.pt")["packed_primitives"]
    print({k: f"{v:.2e}" for k, v in errs.items()})
    assert len(errs) == 24  # 7 fla, 7 torch-chain, 6 conv, 4 attention checks
    for name, err in errs.items():
        assert err < (1e-2 if name.startswith("kda_fla") else 1e-4), (name, err)


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
@pytest.mark.parametrize("layout", [n for n, (_, _, pp, _) in LAYOUTS.items() if pp == 1])
def test_cp_logits_equal_the_reference(results, layout):
    assert results[layout]["base_logits_err"] < 2e-5
    assert results[layout]["lora_logits_effect"] > 1e-2
    assert results[layout]["lora_logits_err"] < 1e-4


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_initial_adapters_equal_tp1(results, layout):
    base, got = results["tp1"]["initial"], results[layout]["initial"]
    assert sorted(got) == sorted(base)
    for name in base:
        assert torch.equal(got[name], base[name]), name


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_forward_log_probs_equal_tp1_in_sequence_order(results, layout):
    base, got = results["tp1"]["log_probs"], results[layout]["log_probs"]
    assert len(got) == len(base) == 2
    for a, b in zip(got, base):
        assert a.shape == b.shape == (2, 16)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_losses_equal_tp1_over_three_adam_steps(results, layout):
    assert_losses_equal(results[layout]["loss"], results["tp1"]["loss"], STEPS)


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_lora_gradients_equal_tp1(results, layout):
    assert_gradients_equal(results[layout]["grads"], results["tp1"]["grads"], STEPS)


@pytest.mark.slow  # the module fixture runs the TP1 and CP layouts in workers: ~65 s on 2 cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_final_adapters_equal_tp1(results, layout):
    assert_adapters_equal(results[layout]["final"], results["tp1"]["final"])


# ---------------------------------------------------------------------------------------------- in-process tests
def test_load_balanced_split_holds_chunks_r_and_mirror():
    from k3.megatron.context_parallel import (
        cp_chunk_ids,
        cp_token_positions,
        merge_cp_shards,
        split_for_cp_rank,
    )

    t = torch.arange(16).view(1, 16)
    assert [cp_chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    shards = [split_for_cp_rank(t, 1, 4, r) for r in range(4)]
    assert shards[0].tolist() == [[0, 1, 14, 15]] and shards[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(merge_cp_shards(shards, 1), t)
    assert cp_token_positions(4, 4, 1).tolist() == [2, 3, 12, 13]
    assert split_for_cp_rank(t, 1, 1, 0) is t


def test_layout_errors_say_what_is_wrong():
    from k3.megatron.context_parallel import (
        cp_chunk_ids,
        merge_cp_shards,
        split_for_cp_rank,
    )

    with pytest.raises(ValueError) as e:
        split_for_cp_rank(torch.zeros(1, 12), 1, 4, 0)
    assert str(e.value) == ("context parallelism 4 needs the sequence length to be a multiple of 2 x 4 = 8 "
                            "(load-balanced split), got 12; pad the batch")
    with pytest.raises(ValueError, match=r"^cp_chunk_ids: rank 2 of CP size 2: expected 0 <= rank < size$"):
        cp_chunk_ids(2, 2)
    with pytest.raises(ValueError, match=r"^merge_cp_shards: local lengths \[4, 6\]: expected one even length"):
        merge_cp_shards([torch.zeros(1, 4), torch.zeros(1, 6)], 1)


class _FakeCPGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_trainer_hands_each_cp_rank_its_tokens_of_every_per_token_tensor(monkeypatch):
    from megatron.core import parallel_state

    from k3.megatron import training
    from k3.megatron.context_parallel import split_for_cp_rank

    ids = torch.arange(16).view(2, 8)
    mb = training.MicroBatch(ids, ids + 100, torch.ones(2, 8), {"old_log_probs": -ids.float(),
                                                                "advantages": torch.tensor([1.0, -1.0])})
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    assert training._cp_local(mb) is mb
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: _FakeCPGroup(1, 2))
    got = training._cp_local(mb)
    assert got.input_ids.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]  # chunks 1 and 2 of 4
    assert torch.equal(got.labels, split_for_cp_rank(ids + 100, 1, 2, 1))
    assert got.loss_mask.shape == (2, 4)
    assert torch.equal(got.extra["old_log_probs"], split_for_cp_rank(-ids.float(), 1, 2, 1))
    assert torch.equal(got.extra["advantages"], mb.extra["advantages"])  # per sequence: whole


def test_short_chunks_and_odd_lengths_are_refused_before_any_exchange():
    from k3.megatron.context_parallel import cp_causal_conv, cp_kda_core
    from k3.model.kda import CausalConv1d

    # 4 local tokens = 2 chunks of 2 < kernel - 1 = 3 halo tokens; no group is touched before the check
    with pytest.raises(ValueError, match=r"each chunk needs at least kernel - 1 = 3 tokens"):
        cp_causal_conv([torch.zeros(1, 4, 2)], [CausalConv1d(2, 4)], group=None)
    with pytest.raises(ValueError, match=r"different kernel sizes \[2, 4\]"):
        cp_causal_conv([torch.zeros(1, 8, 2)] * 2, [CausalConv1d(2, 4), CausalConv1d(2, 2)], group=None)
    q = torch.zeros(1, 5, 1, 2)
    with pytest.raises(ValueError, match=r"5 local tokens: expected an even number"):
        cp_kda_core(q, q, q, q, torch.zeros(1, 5, 1), 1.0, group=None)
    with pytest.raises(ValueError, match=r"backend='cuda': expected auto, fla or torch"):
        cp_kda_core(q, q, q, q, torch.zeros(1, 5, 1), 1.0, group=None, backend="cuda")


def test_attn_res_mixing_needs_no_cp_exchange():
    """A mix over depth is per token: on each CP rank's load-balanced tokens it equals the whole sequence's
    mix of those tokens (to float32 rounding), the input gradients are the slices of the whole gradients, and the
    rank shares of the norm / pseudo-query gradients sum to the whole gradient (what DDP's CP reduction does)."""
    from k3.megatron.context_parallel import split_for_cp_rank
    from k3.model.attn_res import attn_res_mix
    from k3.model.norm import RMSNorm

    gen = torch.Generator().manual_seed(5)
    n, b, s, h, cp = 3, 2, 16, 8, 4
    rows = torch.randn(n, s, b, h, generator=gen)  # bank rows + partial, megatron's [s, b, h]
    weight = torch.randn(s, b, h, generator=gen)
    norm, proj = RMSNorm(h, 1e-5), torch.nn.Linear(h, 1, bias=False)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=gen)
        proj.weight.normal_(0.0, 1.0, generator=gen)

    def run(x, w):
        x = x.detach().clone().requires_grad_(True)
        norm.zero_grad()
        proj.zero_grad()
        out = attn_res_mix(list(x.unbind(0)), norm, proj)
        (out * w).sum().backward()
        return out.detach(), x.grad, norm.weight.grad.clone(), proj.weight.grad.clone()

    full_out, full_gx, full_gn, full_gp = run(rows, weight)
    share_n, share_p = torch.zeros_like(full_gn), torch.zeros_like(full_gp)
    for r in range(cp):
        out, gx, gn, gp = run(split_for_cp_rank(rows, 1, cp, r), split_for_cp_rank(weight, 0, cp, r))
        # the same per-token arithmetic; only the vectorised reduction over the hidden dim may round differently
        torch.testing.assert_close(out, split_for_cp_rank(full_out, 0, cp, r), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(gx, split_for_cp_rank(full_gx, 1, cp, r), rtol=1e-6, atol=1e-7)
        share_n, share_p = share_n + gn, share_p + gp
    torch.testing.assert_close(share_n, full_gn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(share_p, full_gp, rtol=1e-5, atol=1e-6)


def test_bank_pack_unpack_round_trip_is_exact_with_gradients():
    from k3.megatron.layer import pack_stage_output, pushes_before, unpack_stage_input

    gen = torch.Generator().manual_seed(9)
    s, b, h = 6, 2, 4
    rows = pushes_before(13, 12)  # a stage starting at layer 13 receives 2 bank rows
    partial = torch.randn(s, b, h, generator=gen, requires_grad=True)
    bank = torch.randn(rows, s, b, h, generator=gen, requires_grad=True)
    packed = pack_stage_output(partial, bank)
    assert packed.shape == (s, b, (1 + rows) * h)
    p2, b2 = unpack_stage_input(packed, h, rows)
    assert torch.equal(p2, partial) and torch.equal(b2, bank)
    wp, wb = torch.randn(s, b, h, generator=gen), torch.randn(rows, s, b, h, generator=gen)
    ((p2 * wp).sum() + (b2 * wb).sum()).backward()
    assert torch.equal(partial.grad, wp) and torch.equal(bank.grad, wb)  # the gradient routes back unchanged
    p0, b0 = unpack_stage_input(pack_stage_output(partial, None), h, 0)
    assert torch.equal(p0, partial) and b0 is None
    with pytest.raises(ValueError, match=r"layer 13: stage input has width 8, expected \(1 \+ 2 bank rows\) x 4 = 12"):
        unpack_stage_input(packed[..., :8], h, rows, layer=13)


@pytest.mark.parametrize("pp, cp, split", [
    (1, 1, [93]), (2, 1, [47, 46]), (4, 1, [24, 24, 24, 21]), (8, 2, [12] * 7 + [9]), (16, 1, [6] * 15 + [3]),
])
def test_full_model_pp_split_through_megatron_from_the_launch_layout(pp, cp, split):
    """`k3 train --pipeline-parallel-size PP --context-parallel-size CP` on the full variant -> megatron config
    (TP/EP/PP/CP and the uneven first/last stage) -> the layers each stage builds, by megatron's own count."""
    from k3.config import variant
    from k3.launch.args import TrainArgs, resolve
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.spec import get_k3_spec, stage_layers

    layout = resolve(TrainArgs(model_variant="full", num_nodes=16, num_gpus_per_node=4, run_id="t",
                               ipc_unlink_shim=False, pipeline_parallel_size=pp, context_parallel_size=cp)).layout
    sizes = layout  # megatron takes the launcher's layout itself
    assert (sizes.tp, sizes.ep, sizes.pp, sizes.cp) == (layout.tensor_model_parallel_size,
                                                        layout.expert_model_parallel_size, pp, cp)
    config = k3_transformer_config(variant("full"), sizes, perform_initialization=False)
    assert (config.tensor_model_parallel_size, config.context_parallel_size, config.expert_model_parallel_size,
            config.pipeline_model_parallel_size) == (sizes.tp, cp, sizes.ep, pp)
    stages = [stage_layers(config, r) for r in range(pp)]
    assert [len(x) for x in stages] == split
    assert [i for x in stages for i in x] == list(range(93))
    for r, layers in enumerate(stages):
        specs = get_k3_spec(config, r).layer_specs
        # the bank is unpacked at each stage start but the first and packed at each stage end but the last
        assert [s.params["unpack_input"] for s in specs] == [j == 0 and r > 0 for j in range(len(layers))]
        assert [s.params["pack_output"] for s in specs] == [j == len(layers) - 1 and r < pp - 1
                                                           for j in range(len(layers))]


def test_parallel_sizes_validation():
    from k3.settings.parallel import ParallelLayout

    with pytest.raises(ValueError, match=r"ParallelLayout.cp=0: expected an integer >= 1"):
        ParallelLayout.model_parallel(cp=0)
    with pytest.raises(ValueError, match=r"ParallelLayout.first_stage_layers=4: expected None, or an integer >= 1 "
                                         r"with pp > 1"):
        ParallelLayout.model_parallel(first_stage_layers=4)
