"""The rollout-engine protocol suite (DESIGN.md, Contracts), run on every engine that can run here.

* ``embedded``: the reference engine on a tiny random K3 on CPU — always runs, so the suite itself is tested.
* ``sglang``: ``k3.rollout.sglang.engine.SGLangEngine`` — needs sglang importable with CUDA and
  ``K3_SGLANG_CHECKPOINT`` (a BF16 K3 HF checkpoint SGLang can serve, e.g. the 4layer one; ``K3_SGLANG_TP`` GPUs,
  default all visible up to 8). Skipped with the reason otherwise.
* ``fake-sglang``: the same ``SGLangEngine`` and its real SGLang binding, on the test-only ``sglang`` of
  ``tests/fake_sglang`` (SGLang's signatures, the tiny K3 behind them) — always runs on CPU, so the binding
  passes the suite before it meets a GPU.

Each test is self-contained (versions count up from whatever the engine holds), so the order and the
distribution over workers do not matter. Adapters are built from the checkpoint's config alone
(``chunk_layout``): ``B = 0`` must leave every output as the base model's, a random ``B`` must move it.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from k3.config import K3Config, variant
from k3.lora import LoRAConfig
from k3.lora.export import AdapterChunk, chunk_layout
from k3.rollout.protocol import GenerateRequest, RolloutEngine, SamplingParams
from k3.settings.lora import target_names

RANK = 4
PROMPTS = [[17, 40, 51, 88], [23, 99], [64, 65, 66, 67, 68, 69]]


@dataclass
class Rig:
    engine: Any
    make_chunks: Callable[[int, float], list[AdapterChunk]]  # (version, scale of B) -> a complete version
    stop_ids: set[int]


def _chunks_for(cfg: K3Config, lora: LoRAConfig) -> Callable[[int, float], list[AdapterChunk]]:
    layout = chunk_layout(cfg, lora)
    config = lora.peft_config()

    def make(version: int, scale: float) -> list[AdapterChunk]:
        g = torch.Generator().manual_seed(version)
        out = []
        for k, spec in enumerate(layout):
            tensors, made = [], {}
            for name, shape in spec.tensors:
                # gate and up of one MLP share one lora_A (Megatron's fused fc1)
                shared = made.get(name.replace(".up_proj.lora_A.", ".gate_proj.lora_A."))
                t = shared if shared is not None else (
                    torch.randn(*shape, generator=g) * (0.02 if ".lora_A." in name else scale)).bfloat16()
                made[name] = t
                tensors.append((name, t))
            out.append(AdapterChunk(tensors, version, is_first=k == 0, is_last=k == len(layout) - 1,
                                    config=dict(config), group=spec.group, layer=spec.layer))
        return out

    return make


def _embedded() -> Rig:
    from k3.lora import apply_lora
    from k3.model import KimiK3ForCausalLM
    from k3.rollout.embedded.engine import EmbeddedEngine
    from k3.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    cfg = variant("tiny")
    lora = LoRAConfig(rank=RANK, alpha=2 * RANK)
    model = apply_lora(KimiK3ForCausalLM(cfg), lora)
    tok = ByteTokenizer()
    return Rig(EmbeddedEngine(model, tok, max_concurrency=2), _chunks_for(cfg, lora), {tok.eos_id})


def _fake_sglang(tmp: Path) -> Rig:
    import sys

    from k3.model import KimiK3ForCausalLM
    from k3.rollout.sglang.engine import SGLangEngine
    from k3.rollout.sglang.server_args import build_server_args
    from k3.tokenizer import ByteTokenizer

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("a real sglang is installed here: the fake would shadow it")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fake_sglang"))
    torch.manual_seed(0)
    cfg = variant("tiny")
    KimiK3ForCausalLM(cfg.replace(quantization_config=None)).save_pretrained(tmp / "base")
    lora = LoRAConfig(rank=RANK, alpha=2 * RANK)
    args = build_server_args({"hf_checkpoint": str(tmp / "base"), "model_variant": "tiny",
                              "rollout_num_gpus_per_engine": 1, "lora_rank": RANK,
                              "target_modules": list(target_names()), "sglang_max_running_requests": 2})
    tok = ByteTokenizer()
    return Rig(SGLangEngine(args, tokenizer=tok), _chunks_for(cfg, lora), {tok.eos_id})


def _drop_fake_sglang() -> None:
    import sys

    fake = str(Path(__file__).resolve().parents[1] / "fake_sglang")
    if fake in sys.path:
        sys.path.remove(fake)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


def _sglang() -> Rig:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (pip install 'k3-lora-rl[cluster]' on a CUDA machine)")
    if not torch.cuda.is_available():
        pytest.skip("the SGLang engine needs CUDA")
    ckpt = os.environ.get("K3_SGLANG_CHECKPOINT")
    if not ckpt or not (Path(ckpt) / "config.json").is_file():
        pytest.skip("set K3_SGLANG_CHECKPOINT to a BF16 K3 HF checkpoint SGLang can serve (e.g. the 4layer one)")
    from k3.rollout.sglang.engine import SGLangEngine
    from k3.rollout.sglang.server_args import build_server_args
    from k3.tokenizer import load_tokenizer

    cfg = K3Config.from_json(Path(ckpt) / "config.json")
    lora = LoRAConfig(rank=RANK, alpha=2 * RANK)
    gpus = torch.cuda.device_count()
    tp = int(os.environ.get("K3_SGLANG_TP", min(8, gpus)))
    args = build_server_args({
        "hf_checkpoint": ckpt, "model_variant": "full" if cfg.num_hidden_layers == 93 else "4layer",
        "rollout_num_gpus_per_engine": tp, "sglang_ep_size": tp, "num_gpus_per_node": gpus, "lora_rank": RANK,
        "target_modules": list(target_names()), "sglang_max_running_requests": 8, "sglang_context_length": 4096,
        "sglang_mem_fraction_static": 0.5, "seed": 0,
    })
    tok = load_tokenizer(ckpt)
    return Rig(SGLangEngine(args, tokenizer=tok), _chunks_for(cfg, lora), {tok.eos_id})


@pytest.fixture(scope="module", params=["embedded", "fake-sglang", "sglang"])
def rig(request, tmp_path_factory):
    if request.param == "fake-sglang":
        try:
            r = _fake_sglang(tmp_path_factory.mktemp("fake_sglang"))
        except BaseException:
            _drop_fake_sglang()
            raise
    else:
        r = _embedded() if request.param == "embedded" else _sglang()
    yield r
    r.engine.shutdown()
    if request.param == "fake-sglang":
        _drop_fake_sglang()


def requests() -> list[GenerateRequest]:
    return [GenerateRequest(list(p), meta={"i": i}) for i, p in enumerate(PROMPTS)]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def test_engine_implements_the_protocol(rig):
    assert isinstance(rig.engine, RolloutEngine)


def test_generate_returns_one_sample_per_request_in_order(rig):
    reqs = requests()
    out = rig.engine.generate(reqs, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5, seed=3))
    assert len(out) == len(reqs)
    for s, r in zip(out, reqs):
        assert s.prompt_ids == r.prompt_ids and s.meta == r.meta
        assert 1 <= len(s.tokens) <= 5 and len(s.logprobs) == len(s.tokens)
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in s.logprobs)
        assert isinstance(s.text, str)
        assert s.adapter_version == rig.engine.adapter_version()
        if s.finish_reason == "stop":
            assert s.tokens[-1] in rig.stop_ids
        else:
            assert s.finish_reason == "length" and len(s.tokens) == 5
    assert rig.engine.generate([], GREEDY) == []


def test_greedy_generation_is_repeatable(rig):
    a = rig.engine.generate(requests(), GREEDY)
    b = rig.engine.generate(requests(), GREEDY)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-3)


def test_a_zero_adapter_keeps_the_output_and_a_random_one_moves_it(rig):
    e = rig.engine
    v = e.adapter_version() + 1
    e.load_adapter(rig.make_chunks(v, 0.0), v)
    assert e.adapter_version() == v
    base = e.generate(requests(), GREEDY)
    assert all(s.adapter_version == v for s in base)
    e.load_adapter(rig.make_chunks(v + 1, 0.0), v + 1)  # another zero version: still the base model's output
    again = e.generate(requests(), GREEDY)
    assert [s.tokens for s in again] == [s.tokens for s in base]
    e.load_adapter(rig.make_chunks(v + 2, 1.0), v + 2)
    moved = e.generate(requests(), GREEDY)
    assert all(s.adapter_version == v + 2 for s in moved)
    first = [(s.tokens[0], s.logprobs[0]) for s in base]
    after = [(s.tokens[0], s.logprobs[0]) for s in moved]
    assert any(t0 != t1 or abs(l0 - l1) > 1e-3 for (t0, l0), (t1, l1) in zip(first, after))


def test_a_stale_version_is_refused_and_changes_nothing(rig):
    e = rig.engine
    v = e.adapter_version() + 1
    e.load_adapter(rig.make_chunks(v, 0.0), v)
    for stale in (v, v - 1):
        with pytest.raises(ValueError, match="not newer"):
            e.load_adapter(rig.make_chunks(stale, 0.0), stale)
    assert e.adapter_version() == v


def test_an_incomplete_version_is_refused(rig):
    e = rig.engine
    v = e.adapter_version() + 1
    e.load_adapter(rig.make_chunks(v, 0.0), v)
    with pytest.raises(ValueError):
        e.load_adapter(rig.make_chunks(v + 1, 0.0)[:-1], v + 1)
    if getattr(e, "load_mode", "whole") == "streamed" and not getattr(e, "atomic_swap", False):
        # Streamed SGLang loading unloads the old version first (the recipe's order): it now serves the base.
        assert e.adapter_version() == 0
    else:
        assert e.adapter_version() == v
    w = e.adapter_version() + 1
    e.load_adapter(rig.make_chunks(w, 0.0), w)  # a complete version goes in afterwards
    assert e.adapter_version() == w


def test_memory_release_and_resume_keep_the_model(rig):
    e = rig.engine
    before = e.generate(requests(), GREEDY)
    e.release_memory(["kv_cache", "cuda_graph"])
    e.release_memory(["weights"])
    e.release_memory(["weights"])  # idempotent
    with pytest.raises(RuntimeError, match="released"):
        e.generate(requests(), GREEDY)
    e.resume_memory(["weights"])
    e.resume_memory(["kv_cache", "cuda_graph", "weights"])
    after = e.generate(requests(), GREEDY)
    assert [s.tokens for s in after] == [s.tokens for s in before]
    with pytest.raises(ValueError, match="unknown memory tags"):
        e.release_memory(["activations"])
