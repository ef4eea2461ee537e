"""Routed experts with shared-outer LoRA on CUDA vs the CPU path (``gpu``), and the benchmark's own pieces on the
CPU (the forced grouped-GEMM implementation, an end-to-end run at tiny shapes).

Tolerances: float32 on CUDA vs float32 on the CPU differ only in summation order (TF32 is off for matmuls by
default): 1e-5 relative. BF16 on CUDA vs the float32 CPU path on the same BF16-rounded weights: 2e-2 relative
Frobenius error (BF16 activations between the GEMMs).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import k3.kernels.expert_lora.folded as folded_mod
import k3.kernels.expert_lora.function as lora_function_mod
import k3.lora.experts as lora_experts_mod
import k3.model.moe as moe_mod
from k3.kernels.expert_lora.triton import DEFAULT_BLOCKS, cpu_interpreter_problem
from k3.kernels.grouped_mm import grouped_mm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_expert_lora.py"
REL_FP32 = 1e-5
REL_BF16 = 2e-2


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_expert_lora", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def small_problem(dtype=torch.float32, device="cpu", alpha=12.0):
    base, lora = bench.build(E=5, Lt=64, Fi=48, rank=8, alpha=alpha, dtype=dtype, device=torch.device(device))
    counts = bench.expert_counts(5, 7, seed=3)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(int(counts.sum()), 64, generator=gen)
    dy = torch.randn(int(counts.sum()), 64, generator=gen)
    return base, lora, counts, x, dy


def forward_backward(module, x, counts, dy):
    """Output and the gradients w.r.t. the input and every LoRA factor (None for the base)."""
    x = x.detach().clone().requires_grad_()
    out = module(x, counts)
    names = list(module.factor_names()) if hasattr(module, "factor_names") else []
    wrt = [x] + [getattr(module, n) for n in names]
    grads = torch.autograd.grad(out, wrt, grad_outputs=dy.to(out.dtype))
    return out.detach(), dict(zip(["x", *names], grads))


# ------------------------------------------------------------------------------------------------ CPU
def test_expert_counts_are_seeded_and_sum_to_the_rows():
    c = bench.expert_counts(112, 146, seed=0)
    assert c.shape == (112,) and int(c.sum()) == 112 * 146 and c.dtype == torch.int64
    assert torch.equal(c, bench.expert_counts(112, 146, seed=0)) and int(c.max()) > int(c.min())


def test_forced_impl_patches_every_module_and_restores_them():
    def current():
        return (moe_mod.grouped_mm, lora_experts_mod.grouped_mm, folded_mod.grouped_mm,
                folded_mod.grouped_weight_grad, lora_function_mod.grouped_mm)

    before = current()
    with bench.forced_impl("padded"):
        assert moe_mod.grouped_mm.keywords == {"impl": "padded"}
        assert lora_experts_mod.grouped_mm is moe_mod.grouped_mm is folded_mod.grouped_mm
        assert lora_function_mod.grouped_mm is moe_mod.grouped_mm
        assert folded_mod.grouped_weight_grad.keywords == {"impl": "padded"}
    assert current() == before
    with pytest.raises(RuntimeError), bench.forced_impl("native"):
        raise RuntimeError("boom")
    assert current() == before


@pytest.mark.parametrize("impl", ["native", "padded"])
def test_native_and_padded_agree_on_the_cpu(impl):
    _, lora, counts, x, dy = small_problem()
    with bench.forced_impl(impl):
        out, grads = forward_backward(lora, x, counts, dy)
    with bench.forced_impl("padded"):
        ref_out, ref_grads = forward_backward(lora, x, counts, dy)
    # the base GEMM of expert 0 by hand
    n0 = int(counts[0])
    torch.testing.assert_close(grouped_mm(x, lora.w1, counts)[:n0], x[:n0] @ lora.w1[0].T, rtol=1e-5, atol=1e-5)
    assert rel_err(out, ref_out) <= REL_FP32
    assert all(rel_err(grads[n], ref_grads[n]) <= REL_FP32 for n in grads)


@pytest.fixture
def no_triton_path(monkeypatch):
    """The bench's module list without the triton path (it appears where Triton runs, e.g. under the interpreter)."""
    monkeypatch.setattr(bench, "triton_status", lambda device: "off in this test")


def test_bench_runs_end_to_end_on_the_cpu(tmp_path, capsys, no_triton_path):
    out = tmp_path / "lora.json"
    result = bench.main(["--device", "cpu", "--dtype", "fp32", "--experts", "4", "--latent", "32", "--width", "48",
                         "--tokens-per-expert", "5", "--rank", "4", "--repeats", "2", "--warmup", "1",
                         "--impls", "native,padded", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(r["impl"], r["lora"]) for r in result["results"]] == [
        ("native", "fused"), ("native", "plain"), ("padded", "fused"), ("padded", "plain")]
    for r in result["results"]:
        assert r["base_fwd_bwd_ms"] > 0 and r["overhead_fwd_bwd"] == pytest.approx(
            r["lora_fwd_bwd_ms"] / r["base_fwd_bwd_ms"] - 1)
    assert result["shape"]["rows"] == 20
    agree = result["lora_output_agreement"]
    assert [a["pair"] for a in agree] == ["native/plain vs native/fused", "padded/fused vs native/fused",
                                          "padded/plain vs native/fused"]
    assert all(a["rel"] <= REL_FP32 for a in agree)
    assert result["triton_lora"]["runs"] is False and result["triton_lora"]["why_not"] == "off in this test"
    printed = capsys.readouterr().out
    assert "| native | fused |" in printed and "No triton LoRA path: off in this test" in printed


def test_a_failing_triton_path_costs_only_its_own_rows(monkeypatch, capsys):
    """On a lease the Triton path compiles for the first time inside the bench: if it fails, the base, fused and
    plain numbers of the same run must survive. Forced here by a Triton path whose kernels raise."""
    monkeypatch.setattr(bench, "triton_status", lambda device: None)  # take the triton path on board anyway

    def broken(*args, **kwargs):
        raise RuntimeError("planted kernel failure")

    monkeypatch.setattr(lora_function_mod, "lora_gate_up", broken)
    monkeypatch.setattr(lora_experts_mod.LoRALatentExperts, "_use_triton", lambda self, rows: self.lora_impl == "triton")
    result = bench.main(["--device", "cpu", "--dtype", "fp32", "--experts", "4", "--latent", "32", "--width", "48",
                         "--tokens-per-expert", "5", "--rank", "4", "--repeats", "1", "--warmup", "1",
                         "--impls", "native,padded", "--profile"])
    rows = [(r["impl"], r["lora"], "skipped" in r) for r in result["results"]]
    assert rows == [("native", "triton", True), ("native", "fused", False), ("native", "plain", False),
                    ("padded", "triton", True), ("padded", "fused", False), ("padded", "plain", False)]
    assert "planted kernel failure" in result["results"][0]["skipped"]
    assert set(result["profiles"]) == {"base", "fused", "plain"}
    assert "| native | triton | triton failed: RuntimeError: planted kernel failure" in capsys.readouterr().out


_NO_TRITON = cpu_interpreter_problem()
needs_triton_here = pytest.mark.skipif(_NO_TRITON is not None, reason=_NO_TRITON or "")


@needs_triton_here
def test_triton_lora_rows_where_triton_runs(capsys):
    defaults = {k: v["block_m"] for k, v in DEFAULT_BLOCKS.items()}
    result = bench.main(["--device", "cpu", "--dtype", "fp32", "--experts", "4", "--latent", "32", "--width", "48",
                         "--tokens-per-expert", "9", "--rank", "4", "--repeats", "1", "--warmup", "1",
                         "--impls", "native", "--triton-block-m", "16"])
    assert [r["lora"] for r in result["results"]] == ["fused", "plain", "triton", "triton bm16"]
    assert result["triton_lora"]["runs"] and result["triton_lora"]["block_m"] == {"triton": None, "triton bm16": 16}
    assert [a["pair"] for a in result["lora_output_agreement"]][-2:] == [
        "native/triton vs native/fused", "native/triton bm16 vs native/fused"]
    assert all(a["rel"] <= REL_FP32 for a in result["lora_output_agreement"])
    assert {k: v["block_m"] for k, v in DEFAULT_BLOCKS.items()} == defaults  # restored
    assert "| native | triton bm16 |" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_float32_matches_the_cpu_path():
    _, lora, counts, x, dy = small_problem()
    out, grads = forward_backward(lora, x, counts, dy)
    lora_cuda = copy.deepcopy(lora).cuda()
    out_c, grads_c = forward_backward(lora_cuda, x.cuda(), counts.cuda(), dy.cuda())
    assert out_c.is_cuda and rel_err(out_c, out) <= REL_FP32
    for n in grads:
        assert rel_err(grads_c[n], grads[n]) <= REL_FP32, n


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("impl", ["native", "padded"])
def test_cuda_bf16_matches_the_cpu_float32_path(impl, fused):
    bench.native_grouped_mm_shim()
    _, lora, counts, x, dy = small_problem()
    lora.fused = fused
    lora_bf16 = copy.deepcopy(lora).to(device="cuda", dtype=torch.bfloat16)
    lora_ref = copy.deepcopy(lora_bf16).to(device="cpu", dtype=torch.float32)  # the same rounded weights
    xb, dyb = x.bfloat16(), dy.bfloat16()
    if impl == "native":
        from k3.kernels.grouped_mm import native_grouped_mm_supported

        if not native_grouped_mm_supported(xb.cuda(), lora_bf16.w1):
            pytest.skip("no native grouped GEMM for BF16 on this GPU / torch")
    with bench.forced_impl(impl):
        out_c, grads_c = forward_backward(lora_bf16, xb.cuda(), counts.cuda(), dyb.cuda())
    out, grads = forward_backward(lora_ref, xb.float(), counts, dyb.float())
    errs = {"out": rel_err(out_c, out), **{n: rel_err(grads_c[n], grads[n]) for n in grads}}
    print(impl, {k: f"{v:.1e}" for k, v in errs.items()})
    assert all(e <= REL_BF16 for e in errs.values()), errs


def test_grouped_mm_shape_sweep_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu_grouped_mm", BENCH.parent / "gpu_grouped_mm.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.json"
    result = sweep.main(["--device", "cpu", "--dtype", "fp32", "--experts", "4", "--latent", "64", "--width", "48",
                         "--tokens-per-expert", "5", "--rank", "8", "--repeats", "2", "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    by_name = {r["name"]: r for r in result["results"]}
    assert by_name["gate/up base"]["vs_base"] == 1.0 and by_name["down base"]["vs_flops"] == 1.0
    assert by_name["gate/up K+r padded to 128"]["K"] == 128 and by_name["down N+r"]["N"] == 72
    sliced = by_name["gate/up K+r, A a slice of [rows, K+2r]"]
    assert (sliced["K"], sliced["a_width"]) == (72, 80)
    assert result["rows"] == 20 and "| gate/up base | 64 | 48 |" in capsys.readouterr().out


def test_profile_flag_prints_a_kernel_table_per_module(capsys, no_triton_path):
    result = bench.main(["--device", "cpu", "--dtype", "fp32", "--experts", "4", "--latent", "32", "--width", "48",
                         "--tokens-per-expert", "5", "--rank", "4", "--repeats", "1", "--warmup", "1",
                         "--impls", "native", "--profile"])
    assert set(result["profiles"]) == {"base", "fused", "plain"}
    assert all("Self CPU" in t for t in result["profiles"].values())
    assert capsys.readouterr().err.count("== profile") == 3


def test_fused_layout_variants_are_timed_and_agree(no_triton_path):
    result = bench.main(["--device", "cpu", "--dtype", "fp32", "--experts", "4", "--latent", "32", "--width", "48",
                         "--tokens-per-expert", "5", "--rank", "4", "--repeats", "1", "--warmup", "1",
                         "--impls", "native", "--fused-layouts", "8s,16x"])
    assert [r["lora"] for r in result["results"]] == ["fused", "fused 8s", "fused 16x", "plain"]
    assert all(a["rel"] <= REL_FP32 for a in result["lora_output_agreement"])
