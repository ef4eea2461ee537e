"""bench/embedded_decode.py runs on CPU with --tiny (seconds): every CPU path timed against the limit, the GPU
paths skipped with their reason, and the weight bytes of a step in closed form."""

import json
import math

import pytest
import torch

from bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("embedded_decode")


def test_tiny_run_reports_every_path_against_the_limit(bench, tmp_path):
    out = tmp_path / "decode.json"
    result = bench.main(["--tiny", "--batches", "1,3", "--steps", "3", "--repeats", "1", "--prompt-len", "4",
                         "--prefill-tokens", "16", "--copy-mib", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["model"]["variant"] == "tiny" and result["copy_bandwidth_gb_s"] > 0
    assert result["prefill"]["tokens_per_s"] > 0
    for B in ("1", "3"):
        assert result["limit"][B]["limit_ms"] > 0
        for path in ("eager", "static", "window"):
            row = result["decode"][path][B]
            assert math.isfinite(row["ms_per_step"]) and row["ratio_to_limit"] == pytest.approx(
                result["limit"][B]["limit_ms"] / row["ms_per_step"])
            assert row["graph_fallback"] is None
        # the static cache gives the reference's tokens exactly; the absorbed window, the same greedy tokens here
        assert result["decode"]["static"][B]["greedy_tokens_equal_first_path"] == 1.0
        assert result["decode"]["window"][B]["greedy_tokens_equal_first_path"] == 1.0
        if not torch.cuda.is_available():
            assert "CUDA graphs need a CUDA device" in result["decode"]["graph"][B]["skipped"]
            assert "skipped" in result["decode"]["flashinfer"][B]


def test_weight_bytes_of_a_step(bench):
    from k3.config import variant
    from k3.model import KimiK3ForCausalLM
    from k3.model.moe import LatentExperts

    cfg = variant("tiny")
    model = KimiK3ForCausalLM(cfg)
    experts = sum(p.numel() * 4 for m in model.modules() if isinstance(m, LatentExperts) for p in m.parameters())
    embedding = model.model.embed_tokens.weight.numel() * 4
    rest = sum(p.numel() * 4 for p in model.parameters()) - experts - embedding
    k, E, H = cfg.num_experts_per_token, cfg.num_experts, cfg.hidden_size
    assert bench.weight_bytes_per_step(model, 1, k) == rest + int(experts * k / E) + H * 4
    # a large batch touches (almost) every expert
    assert bench.weight_bytes_per_step(model, 4096, k) == rest + experts + 4096 * H * 4


def test_profile_splits_a_step_into_its_operators(bench, monkeypatch):
    """--profile: per step, each operator's time is the difference of two profiled generate calls over the steps
    between them, so the per-call costs cancel; the sum over every name is reported beside the largest ones."""
    result = bench.main(["--tiny", "--batches", "1,2", "--steps", "2", "--repeats", "1", "--prompt-len", "4",
                         "--prefill-tokens", "16", "--copy-mib", "8", "--paths", "static", "--profile"])
    assert "profile" not in result["decode"]["static"]["1"]  # the largest batch only
    prof = result["decode"]["static"]["2"]["profile"]
    assert 0 < len(prof["top"]) <= 20
    assert [k["us"] for k in prof["top"]] == sorted((k["us"] for k in prof["top"]), reverse=True)
    assert prof["kernel_us_per_step"] >= sum(k["us"] for k in prof["top"]) - 1e-6
    assert {"aten::mm", "aten::_grouped_mm"} & {k["name"] for k in prof["top"]}

    # the arithmetic, on fixed readings: (long - short) / steps per name, a name only in the long call from 0
    readings = iter([{"a": (2, 100.0), "b": (1, 10.0)}, {"a": (6, 300.0), "b": (1, 10.0), "c": (4, 40.0)}])
    monkeypatch.setattr(bench, "_op_times_us", lambda engine, prompts, n: next(readings))
    prof = bench.step_profile(None, [[1]], steps=2, top=2)
    assert prof == {"kernel_us_per_step": 120.0, "top": [{"name": "a", "calls": 2.0, "us": 100.0},
                                                         {"name": "c", "calls": 2.0, "us": 20.0}]}
