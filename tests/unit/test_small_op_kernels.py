"""The fused kernels of the model's small ops (``k3.kernels.rms_norm``, ``situ``, ``attn_res_mix``, ``head_norms``)
against their plain forms, and the dispatch that picks between them.

Where each part runs: the dispatch's refusals everywhere (in the project's venv, without Triton, every call is the
plain form); the kernels on the CPU under Triton's interpreter (``make test-interpret``), which computes float32 as
the GPU does but truncates float32 -> BF16 where the GPU rounds to nearest even, so BF16 is held to one BF16 ulp
there; and on a GPU (gpu-marked) in BF16, where the roundings are the GPU's own.
"""

from __future__ import annotations

import pytest
import torch

from k3.kernels import availability
from k3.kernels.attn_res_mix import attn_res_mix, attn_res_mix_naive, attn_res_mix_triton
from k3.kernels.small_ops_mode import triton_small_ops, triton_small_ops_on, triton_serves
from k3.kernels.head_norms import (gated_rms_norm, gated_rms_norm_naive, gated_rms_norm_triton, l2_norm, l2_norm_naive,
                                   l2_norm_triton)
from k3.kernels.rms_norm import rms_norm, rms_norm_naive, rms_norm_triton
from k3.kernels.situ import situ, situ_naive, situ_triton

RUNS_HERE = availability.triton_runs_on("cpu")  # the interpreter
needs_interpreter = pytest.mark.skipif(not RUNS_HERE, reason="needs TRITON_INTERPRET=1 with Triton (make "
                                       "test-interpret)")
ULP_BF16 = 2.0**-7  # relative spacing of BF16 values in [1, 2)


def _rows(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _within_ulps(got: torch.Tensor, want: torch.Tensor, ulp: float, ulps: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    bound = ulps * ulp * w.abs().clamp_min(torch.finfo(want.dtype).tiny)
    worst = ((g - w).abs() / bound).max().item()
    assert worst <= 1.0, f"off by {worst * ulps:.2f} ulps"


# ------------------------------------------------------------------------------------------------ the switch
def test_the_switch_is_off_outside_its_block_and_nests():
    assert not triton_small_ops_on()
    with triton_small_ops():
        assert triton_small_ops_on()
        with triton_small_ops(False):
            assert not triton_small_ops_on()
        assert triton_small_ops_on()
    assert not triton_small_ops_on()


def test_without_the_switch_or_with_a_gradient_the_plain_forms_serve():
    x, w = _rows((3, 40), torch.float32), _rows((40,), torch.float32, 1.0, 1)
    assert not triton_serves(x, w)  # switch off
    with triton_small_ops():
        assert triton_serves(x, w) == RUNS_HERE
        assert not triton_serves(x.requires_grad_(), w)  # a gradient to carry: the kernels have no backward
        with torch.no_grad():
            assert triton_serves(x, w) == RUNS_HERE
    x = x.detach()
    with triton_small_ops():  # where the kernel does not run, the plain form's very bits
        if not RUNS_HERE:
            assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_naive(x, w, 1e-6))
            assert torch.equal(situ(x, x * 2), situ_naive(x, x * 2))


def test_the_kernels_refuse_bad_shapes():
    x = torch.zeros(2, 8)
    missing = "Triton is not installed"
    for candidates, nw, pw, message in (
            ([], torch.ones(8), torch.ones(1, 8), "no candidates to mix"),
            ([x, torch.zeros(2, 4)], torch.ones(8), torch.ones(1, 8), r"expected one shape on one device"),
            ([x], torch.ones(8), torch.ones(8), r"expected \(8,\) and \(1, 8\)"),
            ([x], torch.ones(8), torch.ones(1, 8, device="meta"), r"candidates on cpu, weights on cpu and meta")):
        with pytest.raises((ValueError, RuntimeError), match=f"{message}|{missing}"):
            attn_res_mix_triton(candidates, nw, pw, 1e-6)
    with pytest.raises((ValueError, RuntimeError), match=rf"expected one shape and a weight of \(8,\)|{missing}"):
        gated_rms_norm_triton(x, x[:, :4], torch.ones(8), 1e-6, torch.float32)
    with pytest.raises((ValueError, RuntimeError), match=rf"rows of 2048 > 1024|{missing}"):
        l2_norm_triton(torch.zeros(2, 2048), 1e-6)
    with pytest.raises((ValueError, RuntimeError), match=r"weight \(7,\) for rows of 8|Triton is not installed"):
        rms_norm_triton(x, torch.ones(7), 1e-6)
    with pytest.raises((ValueError, RuntimeError), match=r"gate \(2, 8\) and up \(2, 4\)|Triton is not installed"):
        situ_triton(x, torch.zeros(2, 4))


# ------------------------------------------------------------------------------------------------ the interpreter
@needs_interpreter
@pytest.mark.parametrize("shape", [(5, 7168), (2, 3, 512), (4, 33), (1, 1)])
def test_rms_norm_float32_is_the_reference_within_float32_ulps(shape):
    x, w = _rows(shape, torch.float32), _rows(shape[-1:], torch.float32, 0.5, 1) + 1
    _within_ulps(rms_norm_triton(x, w, 1e-6), rms_norm_naive(x, w, 1e-6), 2.0**-23, 4)


@needs_interpreter
def test_rms_norm_bf16_rounds_twice_like_the_reference_within_one_bf16_ulp():
    x, w = _rows((6, 1536), torch.bfloat16), (_rows((1536,), torch.float32, 0.1, 1) + 1).to(torch.bfloat16)
    got, want = rms_norm_triton(x, w, 1e-6), rms_norm_naive(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    _within_ulps(got, want, ULP_BF16, 2)  # the interpreter truncates each of the two casts
    w32 = w.float()  # a float32 weight promotes the result, as torch does
    assert rms_norm_triton(x, w32, 1e-6).dtype == rms_norm_naive(x, w32, 1e-6).dtype == torch.float32


@needs_interpreter
def test_rms_norm_of_a_strided_view_and_of_no_rows():
    x = _rows((4, 96), torch.float32)[:, ::2]
    w = _rows((48,), torch.float32, 0.5, 1) + 1
    _within_ulps(rms_norm_triton(x, w, 1e-5), rms_norm_naive(x, w, 1e-5), 2.0**-23, 4)
    assert rms_norm_triton(torch.zeros(0, 48), w, 1e-5).shape == (0, 48)


@needs_interpreter
def test_situ_float32_is_the_reference_within_float32_ulps_over_its_whole_range():
    """Gates and ups from 0 and tiny (the tanh series) through the switch-over at |z| = 0.05 to saturation."""
    g = torch.cat([torch.tensor([0.0, 1e-7, -1e-4, 0.199, 0.201, -0.2, 30.0, -30.0]), _rows((3000,), torch.float32,
                                                                                              8.0)])
    u = torch.cat([torch.tensor([1.0, -1.0, 1.24, 1.26, 1e-6, 0.0, 200.0, -200.0]), _rows((3000,), torch.float32,
                                                                                            60.0, 1)])
    got, want = situ_triton(g, u), situ_naive(g, u)
    assert got[0] == 0 and got[5] == 0
    _within_ulps(got, want, 2.0**-23, 16)


@needs_interpreter
def test_situ_bf16_and_other_betas_within_one_bf16_ulp():
    g, u = _rows((7, 300), torch.bfloat16, 6.0), _rows((7, 300), torch.bfloat16, 40.0, 1)
    _within_ulps(situ_triton(g, u, 2.0, 10.0), situ_naive(g, u, 2.0, 10.0), ULP_BF16, 1)
    assert situ_triton(g[:0], u[:0]).shape == (0, 300)


def _scaled_error(got: torch.Tensor, want: torch.Tensor, candidates: list[torch.Tensor]) -> float:
    """The largest difference in units of the largest candidate value: a weighted sum can cancel to near zero."""
    scale = max(c.abs().max().item() for c in candidates)
    return (got.double() - want.double()).abs().max().item() / scale


@needs_interpreter
@pytest.mark.parametrize("n, shape", [(1, (4, 64)), (2, (3, 5, 512)), (3, (2, 7168)), (7, (6, 33))])
def test_attn_res_mix_float32_is_the_reference_within_float32_rounding(n, shape):
    """One to seven candidates (K3's bank holds up to six stored blocks and the partial sum), of growing size so the
    softmax is not uniform; the online softmax folds them in one pass."""
    g = torch.Generator().manual_seed(n)
    candidates = [torch.randn(shape, generator=g) * (1 + i) for i in range(n)]
    nw = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    pw = 0.05 * torch.randn(1, shape[-1], generator=g)
    got, want = attn_res_mix_triton(candidates, nw, pw, 1e-6), attn_res_mix_naive(candidates, nw, pw, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _scaled_error(got, want, candidates) <= 8 * 2.0**-23
    if n == 1:
        assert torch.equal(got, candidates[0])  # one candidate: weight 1 exactly


@needs_interpreter
def test_attn_res_mix_bf16_within_one_bf16_ulp_of_the_largest_value():
    g = torch.Generator().manual_seed(9)
    candidates = [(torch.randn(4, 1536, generator=g) * (1 + i)).to(torch.bfloat16) for i in range(3)]
    nw = (1 + 0.1 * torch.randn(1536, generator=g)).to(torch.bfloat16)
    pw = (0.05 * torch.randn(1, 1536, generator=g)).to(torch.bfloat16)
    got, want = attn_res_mix_triton(candidates, nw, pw, 1e-6), attn_res_mix_naive(candidates, nw, pw, 1e-6)
    assert got.dtype == torch.bfloat16
    assert _scaled_error(got, want, candidates) <= ULP_BF16
    assert attn_res_mix_triton([c[:0] for c in candidates], nw, pw, 1e-6).shape == (0, 1536)


@needs_interpreter
@pytest.mark.parametrize("shape", [(5, 96, 128), (3, 33), (40, 7)])
def test_head_norms_float32_are_the_reference_within_float32_ulps(shape):
    """Rows of a KDA head (128), odd ones, and more rows than a program's tile (16) with a partial last tile."""
    x, gate = _rows(shape, torch.float32, 2.0), _rows(shape, torch.float32, 3.0, 1)
    w = _rows(shape[-1:], torch.float32, 0.1, 2) + 1
    _within_ulps(l2_norm_triton(x, 1e-6), l2_norm_naive(x, 1e-6), 2.0**-23, 4)
    _within_ulps(gated_rms_norm_triton(x, gate, w, 1e-6, torch.float32),
                 gated_rms_norm_naive(x, gate, w, 1e-6, torch.float32), 2.0**-23, 8)


@needs_interpreter
def test_head_norms_bf16_in_and_out():
    """bf16 inputs: the L2 norm's output stays float32 (as the model's), the gated norm casts to the asked dtype."""
    x, gate = _rows((4, 96, 128), torch.bfloat16, 2.0), _rows((4, 96, 128), torch.bfloat16, 3.0, 1)
    w = _rows((128,), torch.float32, 0.1, 2) + 1  # the model keeps o_norm's weight float32
    got = l2_norm_triton(x, 1e-6)
    assert got.dtype == torch.float32
    _within_ulps(got, l2_norm_naive(x, 1e-6), 2.0**-23, 4)
    _within_ulps(gated_rms_norm_triton(x, gate, w, 1e-6, torch.bfloat16),
                 gated_rms_norm_naive(x, gate, w, 1e-6, torch.bfloat16), ULP_BF16, 1)
    assert gated_rms_norm_triton(x[:0], gate[:0], w, 1e-6, torch.bfloat16).shape == (0, 96, 128)


@needs_interpreter
def test_inside_the_switch_the_model_s_ops_take_the_kernels():
    """The dispatch the model calls routes to the kernels (here: interpreted on the CPU) without a gradient."""
    x, w = _rows((3, 64), torch.float32), _rows((64,), torch.float32, 0.5, 1) + 1
    with triton_small_ops(), torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_triton(x, w, 1e-6))
        assert torch.equal(situ(x, w.expand(3, 64)), situ_triton(x, w.expand(3, 64)))
        pair = [x, x * 2]
        assert torch.equal(attn_res_mix(pair, w, w[None], 1e-6), attn_res_mix_triton(pair, w, w[None], 1e-6))
        assert torch.equal(l2_norm(x, 1e-6), l2_norm_triton(x, 1e-6))
        assert torch.equal(gated_rms_norm(x, x * 2, w, 1e-6, torch.float32),
                           gated_rms_norm_triton(x, x * 2, w, 1e-6, torch.float32))


@needs_interpreter
def test_the_model_under_the_switch_runs_its_norms_and_situ_as_kernels_with_the_same_logits(monkeypatch):
    """The tiny model (float32) forward under ``triton_small_ops()``: every RMSNorm, SiTU, AttnRes mix and KDA head
    norm goes through the kernels, and the logits are the plain model's within float32 noise."""
    import k3.kernels.attn_res_mix as attn_res_mix_op
    import k3.kernels.head_norms as head_norms_op
    import k3.kernels.rms_norm as rms_norm_op
    import k3.kernels.situ as situ_op
    from k3.config import variant
    from k3.model import KimiK3ForCausalLM

    torch.manual_seed(0)
    model = KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).eval()
    ids = torch.randint(1, 512, (2, 6), generator=torch.Generator().manual_seed(1))
    calls = {"rms_norm": 0, "situ": 0, "attn_res_mix": 0, "l2_norm": 0, "gated_rms_norm": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(rms_norm_op, "rms_norm_triton", counted("rms_norm", rms_norm_op.rms_norm_triton))
    monkeypatch.setattr(situ_op, "situ_triton", counted("situ", situ_op.situ_triton))
    monkeypatch.setattr(attn_res_mix_op, "attn_res_mix_triton", counted("attn_res_mix",
                                                                        attn_res_mix_op.attn_res_mix_triton))
    for name in ("l2_norm", "gated_rms_norm"):
        monkeypatch.setattr(head_norms_op, f"{name}_triton", counted(name, getattr(head_norms_op, f"{name}_triton")))
    with torch.no_grad():
        want = model(ids)
        assert set(calls.values()) == {0}
        with triton_small_ops():
            got = model(ids)
    # every RMSNorm module runs once, but the AttnRes ones (``*_res_norm``: attn_res_mix reads their weights only)
    norms = sum(type(m).__name__ == "RMSNorm" and not name.endswith("res_norm") for name, m in model.named_modules())
    assert calls["rms_norm"] == norms and calls["situ"] > 0
    assert calls["attn_res_mix"] == 2 * len(model.model.layers)  # two per layer but the first's, and the final
    kda_layers = len(model.config.linear_attn_config.kda_layers)
    assert (calls["l2_norm"], calls["gated_rms_norm"]) == (2 * kda_layers, kda_layers)  # q and k; the output
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ------------------------------------------------------------------------------------------------ the probe
def test_the_probe_names_a_kernel_that_does_not_run_or_disagrees(monkeypatch):
    from k3.kernels import small_ops_probe

    problem = small_ops_probe.probe_small_op_kernels("cpu", torch.float32, 64)
    if not RUNS_HERE:  # no Triton in this venv: the build failure is the reason
        assert problem == "RuntimeError: rms_norm_triton: Triton is not installed"
        return
    assert problem is None
    assert small_ops_probe.probe_small_op_kernels("cpu", torch.bfloat16, 7168) is None
    monkeypatch.setattr(small_ops_probe, "situ_triton", lambda g, u: situ_naive(g, u) * 1.001)
    problem = small_ops_probe.probe_small_op_kernels("cpu", torch.float32, 64)
    assert problem.startswith("situ: ") and "values differ from the plain form by more than 3.8e-06 relative" in problem


def test_an_engine_whose_kernels_fail_their_probe_decodes_with_the_plain_ops(monkeypatch, caplog):
    """The plan asked for the kernels (as on CUDA); the probe fails once, says why, and every batch runs the plain
    ops: the same tokens as an engine that never asked."""
    pytest.importorskip("psutil")  # the engine's imports (the interpreter's venv has only the kernels' own)
    import dataclasses
    import logging

    from k3.config import variant
    from k3.kernels import small_ops_probe
    from k3.model import KimiK3ForCausalLM
    from k3.rollout.embedded import engine as engine_mod
    from k3.rollout.embedded.engine import EmbeddedEngine
    from k3.rollout.protocol import GenerateRequest, SamplingParams
    from k3.settings.decode import DecodeSettings
    from k3.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model = KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).eval()
    reqs = [GenerateRequest([5, 6, 7]), GenerateRequest([9])]
    sampling = SamplingParams(temperature=0, max_new_tokens=4)
    plain = EmbeddedEngine(model, ByteTokenizer(), decode=DecodeSettings(mode="window"))
    want = [s.tokens for s in plain.generate(reqs, sampling)]
    engine = EmbeddedEngine(model, ByteTokenizer(), decode=DecodeSettings(mode="window"))
    engine.decode_plan = dataclasses.replace(engine.decode_plan, small_ops="triton")
    probes = []
    monkeypatch.setattr(engine_mod, "probe_small_op_kernels",
                        lambda device, dtype, dim: probes.append((str(device), dtype, dim)) or "RuntimeError: no GPU")
    with caplog.at_level(logging.WARNING, logger=engine_mod.log.name):
        got = [[s.tokens for s in engine.generate(reqs, sampling)] for _ in range(2)]
    assert got == [want, want]
    assert probes == [("cpu", torch.float32, 64)]  # once, at the model's width
    assert engine._small_ops_off == "RuntimeError: no GPU"
    assert "fused small-op kernels failed their probe (RuntimeError: no GPU)" in caplog.text
    assert small_ops_probe.probe_small_op_kernels is not None


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_on_cuda_bf16_kernels_match_the_reference_to_the_last_bit_almost_everywhere():
    """On the GPU the casts round to nearest even as torch's do: RMSNorm differs only where the float32 sum's order
    moves a result across a BF16 rounding boundary, SiTU only where the exp-based tanh does."""
    if not torch.cuda.is_available() or not availability.triton_runs_on("cuda"):
        pytest.skip("needs CUDA and Triton")
    x = _rows((64, 7168), torch.bfloat16).cuda()
    w = (_rows((7168,), torch.float32, 0.1, 1) + 1).to(torch.bfloat16).cuda()
    got, want = rms_norm_triton(x, w, 1e-6), rms_norm_naive(x, w, 1e-6)
    _within_ulps(got, want, ULP_BF16, 1)
    assert (got != want).float().mean().item() < 0.01
    g, u = _rows((64, 3072), torch.bfloat16, 6.0).cuda(), _rows((64, 3072), torch.bfloat16, 40.0, 1).cuda()
    got, want = situ_triton(g, u), situ_naive(g, u)
    _within_ulps(got, want, ULP_BF16, 1)
    assert (got != want).float().mean().item() < 0.01
    with triton_small_ops(), torch.no_grad():  # the model's dispatch takes them on CUDA
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_triton(x, w, 1e-6))
        assert torch.equal(situ(g, u), got)
    blocks = [_rows((64, 7168), torch.bfloat16, 1.0 + i, 2 + i).cuda() for i in range(3)]
    pw = (_rows((1, 7168), torch.float32, 0.05, 5)).to(torch.bfloat16).cuda()
    got, want = attn_res_mix_triton(blocks, w, pw, 1e-6), attn_res_mix_naive(blocks, w, pw, 1e-6)
    assert _scaled_error(got, want, blocks) <= ULP_BF16
    heads, head_gates = x.view(64, 56, 128), _rows((64, 56, 128), torch.bfloat16, 3.0, 6).cuda()
    hw = (_rows((128,), torch.float32, 0.1, 7) + 1).cuda()
    _within_ulps(l2_norm_triton(heads, 1e-6), l2_norm_naive(heads, 1e-6), 2.0**-23, 4)
    got = gated_rms_norm_triton(heads, head_gates, hw, 1e-6, torch.bfloat16)
    want = gated_rms_norm_naive(heads, head_gates, hw, 1e-6, torch.bfloat16)
    _within_ulps(got, want, ULP_BF16, 1)
    assert (got != want).float().mean().item() < 0.01
