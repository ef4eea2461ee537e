"""KDA dispatch: packed sequences (``cu_seqlens``) and the fused gate on the torch path (CPU), what reaches fla
(CPU, with fla's ops replaced by recording stand-ins), and fla on CUDA at K3 head shapes in BF16 (``gpu``).

GPU tolerances are relative Frobenius errors ``‖ours − ref‖ / ‖ref‖`` against the torch chunked core in float32
on the same BF16-rounded inputs: fla keeps intermediate chunk states and scores in BF16 (``h``, ``Aqk``), so
forward outputs/states agree to ~1e-3 and gradients to ~1e-2; the bounds below leave a factor of 3-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.kda import fla as kda_mod
from k3.kernels.kda.chunk import chunk_kda
from k3.kernels.kda.fla import fla_available, kda_core, kda_core_with_gate
from k3.kernels.kda.gate import kda_gate
from k3.kernels.kda.naive import naive_recurrent_kda
import k3.model.kda as model_kda

ATOL = 1e-5
REL_FWD = 1e-2  # fla BF16 vs torch float32: outputs and final states
REL_GRAD = 3e-2  # fla BF16 vs torch float32: every gradient
K3_HEADS, K3_HEAD_DIM, K3_LOWER_BOUND = 96, 128, -5.0


def make_inputs(B=1, T=37, H=3, K=8, V=6, seed=0, n_states=None, device="cpu", decay=K3_LOWER_BOUND):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = decay * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(n_states or B, H, K, V, generator=gen)
    return tuple(t.to(device) for t in (q, k, v, g, beta, s0))


def gate_params(H, K, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(H, generator=gen).mul(0.5).to(device), torch.randn(H * K, generator=gen).to(device))


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


# ------------------------------------------------------------------------------------------------ CPU: packed
@pytest.mark.parametrize("backend", ["torch_chunk", "torch_naive"])
def test_packed_sequences_equal_each_sequence_alone(backend):
    lengths = [5, 1, 0, 23, 17]
    q, k, v, g, beta, s0 = make_inputs(T=sum(lengths), n_states=len(lengths))
    o, s = kda_core(q, k, v, g, beta, initial_state=s0, backend=backend, cu_seqlens=cu(lengths))
    assert o.shape == v.shape and s.shape == s0.shape
    start = 0
    for n, L in enumerate(lengths):
        sl = slice(start, start + L)
        o_n, s_n = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s0[n:n + 1])
        torch.testing.assert_close(o[:, sl], o_n, atol=ATOL, rtol=0)
        torch.testing.assert_close(s[n:n + 1], s_n, atol=ATOL, rtol=0)
        start += L
    assert torch.equal(s[2], s0[2])  # an empty sequence passes its state through


def test_packed_without_initial_state_starts_each_sequence_from_zero():
    lengths = [7, 9]
    q, k, v, g, beta, _ = make_inputs(T=16)
    o, s = kda_core(q, k, v, g, beta, backend="torch_chunk", cu_seqlens=[0, 7, 16])
    o2, s2 = chunk_kda(q[:, 7:], k[:, 7:], v[:, 7:], g[:, 7:], beta[:, 7:])
    torch.testing.assert_close(o[:, 7:], o2, atol=ATOL, rtol=0)
    torch.testing.assert_close(s[1:], s2, atol=ATOL, rtol=0)
    assert s.shape[0] == len(lengths)


def test_packed_gradients_equal_each_sequence_alone():
    lengths = [6, 11]
    base = make_inputs(T=17, n_states=2, seed=2)
    leaves = [t.clone().requires_grad_() for t in base]
    o, s = kda_core(*leaves[:5], initial_state=leaves[5], backend="torch_chunk", cu_seqlens=cu(lengths))
    grads = torch.autograd.grad(o.square().sum() + s.sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in base]
    q, k, v, g, beta, s0 = ref_leaves
    total = 0
    for n, sl in enumerate((slice(0, 6), slice(6, 17))):
        o_n, s_n = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s0[n:n + 1])
        total = total + o_n.square().sum() + s_n.sum()
    for a, b in zip(grads, torch.autograd.grad(total, ref_leaves)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_auto_on_the_cpu_picks_the_recurrence_for_one_token_per_sequence():
    q, k, v, g, beta, s0 = make_inputs(T=3, n_states=3)
    o, s = kda_core(q, k, v, g, beta, initial_state=s0, cu_seqlens=[0, 1, 2, 3])
    o_ref, s_ref = kda_core(q, k, v, g, beta, initial_state=s0, cu_seqlens=[0, 1, 2, 3], backend="torch_naive")
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("bad, match", [
    ([0, 5, 37], None),  # fine: the control case
    ([1, 37], "non-decreasing boundaries from 0 to the 37 tokens"),
    ([0, 36], "non-decreasing boundaries from 0 to the 37 tokens"),
    ([0, 20, 10, 37], "non-decreasing boundaries"),
    ([37], "1-D integer tensor of N \\+ 1"),
    (torch.tensor([0.0, 37.0]), "1-D integer tensor"),
    (torch.tensor([[0, 37]]), "1-D integer tensor"),
])
def test_bad_cu_seqlens_are_clear_errors(bad, match):
    q, k, v, g, beta, _ = make_inputs(T=37)
    if match is None:
        kda_core(q, k, v, g, beta, cu_seqlens=bad)
        return
    with pytest.raises(ValueError, match=match):
        kda_core(q, k, v, g, beta, cu_seqlens=bad)


def test_packed_needs_batch_one_and_one_state_per_sequence():
    q, k, v, g, beta, s0 = make_inputs(B=2, T=10)
    with pytest.raises(ValueError, match="flattened into batch 1, got batch 2"):
        kda_core(q, k, v, g, beta, cu_seqlens=[0, 10])
    q, k, v, g, beta, s0 = make_inputs(T=10, n_states=3)
    with pytest.raises(ValueError, match=r"initial_state \(3, 3, 8, 6\): expected \(2, 3, 8, 6\) \(one per packed "
                                         r"sequence: 2\)"):
        kda_core(q, k, v, g, beta, initial_state=s0, cu_seqlens=[0, 4, 10])


# ------------------------------------------------------------------------------------------------ CPU: the gate
@pytest.mark.parametrize("lower_bound", [K3_LOWER_BOUND, None])
def test_gate_is_the_models_gate_and_its_closed_form(lower_bound):
    assert model_kda.kda_gate is kda_gate  # one formula for the layer and the fla oracle
    z = torch.randn(2, 5, 3, 8) * 3
    A_log, dt_bias = gate_params(3, 8)
    x = z + dt_bias.view(3, 8)
    rate = A_log.exp().view(3, 1)
    want = -rate * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(rate * x)
    torch.testing.assert_close(kda_gate(z, A_log, dt_bias, lower_bound), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lower_bound", [K3_LOWER_BOUND, None])
def test_core_with_gate_on_torch_is_gate_then_core(lower_bound):
    q, k, v, _, beta, s0 = make_inputs(T=21, n_states=2)
    z = torch.randn(q.shape)
    A_log, dt_bias = gate_params(3, 8)
    leaves = [t.clone().requires_grad_() for t in (z, A_log, dt_bias)]
    o, s = kda_core_with_gate(q, k, v, leaves[0], beta, leaves[1], leaves[2], lower_bound, initial_state=s0,
                              cu_seqlens=[0, 9, 21])
    g = kda_gate(z, A_log, dt_bias, lower_bound)
    o_ref, s_ref = kda_core(q, k, v, g, beta, initial_state=s0, cu_seqlens=[0, 9, 21])
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    grads = torch.autograd.grad(o.sum() + s.sum(), leaves)
    assert all(gr is not None and torch.isfinite(gr).all() and gr.abs().sum() > 0 for gr in grads)


def test_core_with_gate_bad_inputs():
    q, k, v, g, beta, _ = make_inputs(T=4)
    A_log, dt_bias = gate_params(3, 8)
    with pytest.raises(ValueError, match="lower_bound=0.0: expected a negative bound or None"):
        kda_core_with_gate(q, k, v, g, beta, A_log, dt_bias, 0.0)
    with pytest.raises(ValueError, match=r"A_log \(2,\), dt_bias \(24,\).*expected .* A_log \[heads\]"):
        kda_core_with_gate(q, k, v, g, beta, A_log[:2], dt_bias, -5.0)
    with pytest.raises(ValueError, match=r"dt_bias \(8,\)"):
        kda_core_with_gate(q, k, v, g, beta, A_log, dt_bias[:8], -5.0)


def test_gate_lower_bound_does_not_change_the_torch_forms():
    q, k, v, g, beta, s0 = make_inputs(T=19)
    plain = kda_core(q, k, v, g, beta, initial_state=s0)
    bounded = kda_core(q, k, v, g, beta, initial_state=s0, gate_lower_bound=K3_LOWER_BOUND)
    assert torch.equal(plain[0], bounded[0]) and torch.equal(plain[1], bounded[1])


def test_fla_backend_without_fla_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kda_mod, "_fla_ops", lambda: None)
    q, k, v, g, beta, _ = make_inputs(T=4)
    with pytest.raises(RuntimeError, match="needs flash-linear-attention"):
        kda_core(q, k, v, g, beta, backend="fla")
    with pytest.raises(RuntimeError, match="needs flash-linear-attention"):
        kda_core_with_gate(q, k, v, g, beta, *gate_params(3, 8), -5.0, backend="fla")


# ------------------------------------------------------------------------------------------------ CPU: what fla gets
class RecordingFla:
    """Stand-ins for fla's ``chunk_kda`` / ``fused_recurrent_kda`` that record their arguments and compute the
    torch reference, so the dispatch's plumbing is checked without fla or a GPU."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def _run(self, name, q, k, v, g, beta, **kw):
        self.calls.append((name, {"dtypes": (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype), **kw}))
        if kw.get("use_gate_in_kernel"):
            g = kda_gate(g, kw["A_log"], kw["dt_bias"], kw["lower_bound"])
        cu_seqlens = kw.get("cu_seqlens")
        return kda_core(q, k, v, g, beta, kw.get("scale"), kw.get("initial_state"), "torch_chunk",
                        cu_seqlens=None if cu_seqlens is None else cu_seqlens.cpu())

    def chunk(self, q, k, v, g, beta, **kw):
        return self._run("chunk", q, k, v, g, beta, **kw)

    def fused(self, q, k, v, g, beta, **kw):
        return self._run("fused", q, k, v, g, beta, **kw)


@pytest.fixture
def recording(monkeypatch):
    rec = RecordingFla()
    monkeypatch.setattr(kda_mod, "_fla_ops", lambda: (rec.chunk, rec.fused))
    return rec


def test_fla_gets_model_dtype_qkv_float32_g_beta_state_and_the_packing(recording):
    q, k, v, g, beta, s0 = make_inputs(T=30, n_states=2)
    v = v.bfloat16()
    o, s = kda_core(q, k, v, g, beta, initial_state=s0, backend="fla", cu_seqlens=torch.tensor([0, 12, 30]),
                    gate_lower_bound=K3_LOWER_BOUND)
    name, kw = recording.calls[-1]
    assert name == "chunk"
    assert kw["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    assert kw["initial_state"].dtype == torch.float32 and kw["output_final_state"] is True
    assert kw["safe_gate"] is True  # -5 is inside fla's safe range
    assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens"].tolist() == [0, 12, 30]
    assert kw["cu_seqlens_cpu"].device.type == "cpu" and kw["cu_seqlens_cpu"].tolist() == [0, 12, 30]
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == s0.shape


@pytest.mark.parametrize("bound, safe", [(None, False), (-5.0, True), (-1.0, True), (-8.0, False)])
def test_safe_gate_only_inside_flas_safe_range(recording, bound, safe):
    q, k, v, g, beta, _ = make_inputs(T=20)
    kda_core(q, k, v, g, beta, backend="fla", gate_lower_bound=bound)
    assert recording.calls[-1][1]["safe_gate"] is safe
    A_log, dt_bias = gate_params(3, 8)
    kda_core_with_gate(q, k, v, g, beta, A_log, dt_bias, bound, backend="fla")
    kw = recording.calls[-1][1]
    assert kw["safe_gate"] is safe and kw["use_gate_in_kernel"] is True and kw["lower_bound"] == bound
    assert kw["A_log"].dtype == kw["dt_bias"].dtype == torch.float32


def test_decode_uses_fused_recurrent_only_without_gradients(recording):
    q, k, v, g, beta, s0 = make_inputs(T=1)
    with torch.no_grad():
        kda_core(q, k, v, g, beta, initial_state=s0, backend="fla")
    assert recording.calls[-1][0] == "fused" and "safe_gate" not in recording.calls[-1][1]
    kda_core(q, k, v, g, beta, initial_state=s0.clone().requires_grad_(), backend="fla")
    assert recording.calls[-1][0] == "chunk"  # fused_recurrent_kda has no backward
    q, k, v, g, beta, s0 = make_inputs(T=3, n_states=3)
    with torch.no_grad():
        kda_core(q, k, v, g, beta, initial_state=s0, backend="fla", cu_seqlens=[0, 1, 2, 3])
        assert recording.calls[-1][0] == "fused"
        kda_core(q, k, v, g, beta, initial_state=s0, backend="fla", cu_seqlens=[0, 1, 1, 3])
        assert recording.calls[-1][0] == "chunk"  # one sequence has two tokens
        kda_core_with_gate(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], *gate_params(3, 8), -5.0,
                           initial_state=s0[:1], backend="fla")
        assert recording.calls[-1][0] == "fused" and recording.calls[-1][1]["use_gate_in_kernel"] is True


def test_fla_path_returns_the_reference_through_the_stand_ins(recording):
    lengths = [8, 13]
    q, k, v, z, beta, s0 = make_inputs(T=21, n_states=2)
    A_log, dt_bias = gate_params(3, 8)
    ours = kda_core_with_gate(q, k, v, z, beta, A_log, dt_bias, -5.0, initial_state=s0, backend="fla",
                              cu_seqlens=cu(lengths))
    ref = kda_core_with_gate(q, k, v, z, beta, A_log, dt_bias, -5.0, initial_state=s0, backend="torch_chunk",
                             cu_seqlens=cu(lengths))
    torch.testing.assert_close(ours[0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------ CUDA: fla
needs_fla = pytest.mark.skipif(not fla_available(), reason="flash-linear-attention with Triton is not importable")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def k3_inputs(T, n_states=1, seed=0, H=K3_HEADS, D=K3_HEAD_DIM):
    """K3 head shapes on CUDA: q, k, v BF16 (rounded once), gates from K3's bounded gate, float32 state."""
    q, k, v, g, beta, s0 = make_inputs(T=T, H=H, K=D, V=D, seed=seed, n_states=n_states, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, s0


def grads_of(fn, leaves, do, ds):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    o, s = fn(*leaves)
    grads = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves, allow_unused=True)
    return o.detach(), s.detach(), grads


def assert_fla_matches_torch(fla_fn, ref_fn, inputs, names, seed=7):
    """Forward and the gradients of ``names`` (the first inputs) of ``fla_fn`` on the BF16 inputs vs ``ref_fn``
    on float32 copies; ``inputs[2]`` is v (the output's shape), ``inputs[5]`` the state's shape."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(inputs[2].shape, generator=gen, device="cuda")
    ds = torch.randn(inputs[5].shape, generator=gen, device="cuda")
    o, s, grads = grads_of(fla_fn, inputs, do, ds)
    o_r, s_r, grads_r = grads_of(ref_fn, [t.float() for t in inputs], do, ds)
    errs = {"o": rel_err(o, o_r), "state": rel_err(s, s_r)}
    errs.update({f"d{n}": rel_err(a, b) for n, a, b in zip(names, grads, grads_r)})
    print({k: f"{v:.2e}" for k, v in errs.items()})
    assert errs["o"] <= REL_FWD and errs["state"] <= REL_FWD, errs
    assert all(errs[f"d{n}"] <= REL_GRAD for n in names), errs


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_chunk_forward_and_gradients_at_k3_shapes(with_state):
    inputs = k3_inputs(T=300)

    def fla(q, k, v, g, beta, s0):
        return kda_core(q, k, v, g, beta, initial_state=s0 if with_state else None, backend="fla")

    def ref(q, k, v, g, beta, s0):
        return kda_core(q, k, v, g, beta, initial_state=s0 if with_state else None, backend="torch_chunk")

    assert_fla_matches_torch(fla, ref, inputs, ["q", "k", "v", "g", "beta"] + (["s0"] if with_state else []))


@pytest.mark.gpu
@needs_fla
def test_fla_packed_sequences_forward_and_gradients():
    lengths = [100, 1, 64, 135]  # a single token, a chunk exactly, chunk boundaries inside sequences
    q, k, v, g, beta, s0 = k3_inputs(T=sum(lengths), n_states=len(lengths), seed=1)

    def fla(*t):
        return kda_core(*t[:5], initial_state=t[5], backend="fla", cu_seqlens=cu(lengths))

    def ref(*t):
        return kda_core(*t[:5], initial_state=t[5], backend="torch_chunk", cu_seqlens=cu(lengths))

    assert_fla_matches_torch(fla, ref, [q, k, v, g, beta, s0], ["q", "k", "v", "g", "beta", "s0"])


@pytest.mark.gpu
@needs_fla
def test_fla_safe_gate_with_k3_bounded_gates():
    q, k, v, g, beta, s0 = k3_inputs(T=256, seed=2)
    assert float(g.min()) > K3_LOWER_BOUND

    def fla(*t):
        return kda_core(*t[:5], initial_state=t[5], backend="fla", gate_lower_bound=K3_LOWER_BOUND)

    def ref(*t):
        return kda_core(*t[:5], initial_state=t[5], backend="torch_chunk")

    assert_fla_matches_torch(fla, ref, [q, k, v, g, beta, s0], ["q", "k", "v", "g", "beta", "s0"])


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("lower_bound", [K3_LOWER_BOUND, None])
def test_fla_fused_gate_forward_and_gradients(lower_bound):
    lengths = [77, 179]
    q, k, v, _, beta, s0 = k3_inputs(T=sum(lengths), n_states=2, seed=3)
    z = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    A_log, dt_bias = gate_params(K3_HEADS, K3_HEAD_DIM, device="cuda")

    def fla(q, k, v, z, beta, s0, A_log, dt_bias):
        return kda_core_with_gate(q, k, v, z, beta, A_log, dt_bias, lower_bound, initial_state=s0, backend="fla",
                                  cu_seqlens=cu(lengths))

    def ref(q, k, v, z, beta, s0, A_log, dt_bias):
        return kda_core_with_gate(q, k, v, z, beta, A_log, dt_bias, lower_bound, initial_state=s0,
                                  backend="torch_chunk", cu_seqlens=cu(lengths))

    assert_fla_matches_torch(fla, ref, [q, k, v, z, beta, s0, A_log, dt_bias],
                             ["q", "k", "v", "z", "beta", "s0", "A_log", "dt_bias"])


@pytest.mark.gpu
@needs_fla
def test_fla_decode_steps_equal_the_recurrence():
    q, k, v, g, beta, s0 = k3_inputs(T=4, n_states=4, seed=5)
    A_log, dt_bias = gate_params(K3_HEADS, K3_HEAD_DIM, device="cuda")
    packed = [0, 1, 2, 3, 4]
    with torch.no_grad():
        o, s = kda_core(q, k, v, g, beta, initial_state=s0, backend="fla", cu_seqlens=packed)
        o_r, s_r = kda_core(q.float(), k.float(), v.float(), g, beta, initial_state=s0, backend="torch_naive",
                            cu_seqlens=packed)
        assert rel_err(o, o_r) <= REL_FWD and rel_err(s, s_r) <= REL_FWD
        # one token of a batch, from a carried state, gate fused
        z = g.clone().normal_()
        o, s = kda_core_with_gate(q[:, :1], k[:, :1], v[:, :1], z[:, :1], beta[:, :1], A_log, dt_bias,
                                  K3_LOWER_BOUND, initial_state=s0[:1], backend="fla")
        o_r, s_r = kda_core_with_gate(q[:, :1].float(), k[:, :1].float(), v[:, :1].float(), z[:, :1], beta[:, :1],
                                      A_log, dt_bias, K3_LOWER_BOUND, initial_state=s0[:1], backend="torch_naive")
        assert rel_err(o, o_r) <= REL_FWD and rel_err(s, s_r) <= REL_FWD


# ------------------------------------------------------------------------------------------------ CPU: the bench runs
def load_bench(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_runs_end_to_end_on_the_cpu_with_stand_ins(recording, tmp_path, capsys):
    import json

    bench = load_bench("gpu_kda")
    out = tmp_path / "kda.json"
    result = bench.main(["--device", "cpu", "--seq-len", "40", "--heads", "2", "--head-dim", "8",
                         "--packed-sequences", "3", "--decode-batch", "2", "--repeats", "2", "--warmup", "1",
                         "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert len(result["rows"]) == 7 and all(r["ours_ms"] > 0 and r["raw_fla_ms"] > 0 for r in result["rows"])
    assert result["rows"][-1]["goal"] is None and result["rows"][0]["goal"] == 1.05
    assert result["accuracy"]["o_identical_to_raw_fla"] and result["accuracy"]["o_rel_vs_torch_fp32"] < 1e-2
    table = capsys.readouterr().out
    assert "| forward | " in table and "| ours / raw |" in table
    names = {name for name, _ in recording.calls}
    assert names == {"chunk", "fused"}
