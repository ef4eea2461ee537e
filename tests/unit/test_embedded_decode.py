"""The embedded engine's decode without the per-token host round trip (issue #21 item 3).

- Results: every mode gives what the per-token loop of the engine before the change gave (copied below as
  ``reference_generate``, and checked against the tokens that engine produced): ``static`` and ``eager`` the same
  tokens, logprobs and finish reasons to the bit on CPU, ``window`` (absorbed MLA) the same tokens with logprobs
  within float32 noise — greedy, seeded top-p sampling, and stop tokens with a second batch whose draws continue the
  first's generator.
- The loop: it syncs with the host once per ``stop_check_interval`` steps (counted at the dispatcher), stops at the
  first check after every row stopped, trims each row at its first stop token and gives back the draws it made past
  the last row's stop.
- Memory: ``kv_cache`` release frees the static cache, ``generate`` refuses until resume, resume allocates it again.
- Settings: bad values and impossible explicit choices are refused; ``auto`` resolves per device.
- GPU (``gpu``): CUDA graphs and flashinfer give eager's greedy tokens, and the graph decode syncs once per check.
"""

from __future__ import annotations

import collections
import copy
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import variant
from k3.kernels.mla_decode import flashinfer as fi
from k3.kernels.mla_decode.naive import mla_decode_masked
from k3.lora import LoRAConfig, apply_lora
from k3.model import KimiK3ForCausalLM
from k3.model.mla import MLAttention
from k3.rollout.embedded.decode_loop import decode_batch
from k3.rollout.embedded.decode_plan import resolve_decode
from k3.rollout.embedded.engine import EmbeddedEngine
from k3.rollout.embedded.sampling import sample_next
from k3.rollout.embedded.steppers import WindowStepper
from k3.rollout.errors import EngineStateError
from k3.rollout.protocol import GenerateRequest, Sample, SamplingParams
from k3.settings.decode import DecodeSettings
from k3.tokenizer import ByteTokenizer

PROMPTS = [[5, 40, 41, 42], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
CONFIGS = {
    "greedy": SamplingParams(temperature=0, max_new_tokens=12),
    "sampled": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=12),
    # rows stop at steps 4, 3 (first batch of 2) and 2 (second batch, whose draws continue the first's generator)
    "stop": SamplingParams(temperature=1.0, seed=11, max_new_tokens=40, stop_token_ids=tuple(range(100, 160))),
}
# What the engine before the change generated for CONFIGS (max_concurrency 2; tokens, finish reason per request).
RECORDED = {
    "greedy": [([440, 287, 350, 287, 24, 396, 334, 462, 441, 416, 42, 171], "length"),
               ([334, 156, 287, 441, 287, 27, 483, 196, 180, 499, 334, 107], "length"),
               ([265, 320, 14, 287, 287, 76, 431, 287, 287, 242, 265, 287], "length")],
    "sampled": [([200, 260, 374, 501, 435, 437, 434, 262, 340, 62, 477, 167], "length"),
                ([179, 445, 170, 42, 307, 223, 113, 319, 11, 148, 155, 71], "length"),
                ([410, 32, 349, 384, 374, 475, 398, 59, 343, 463, 89, 61], "length")],
    "stop": [([210, 269, 172, 385, 144], "stop"), ([9, 19, 419, 115], "stop"), ([260, 458, 125], "stop")],
}


def _model(rank=4, cfg=None):
    torch.manual_seed(0)
    model = apply_lora(KimiK3ForCausalLM(cfg or variant("tiny")), LoRAConfig(rank=rank, alpha=2 * rank))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@torch.no_grad()
def reference_generate(model, tokenizer, requests, sampling, max_concurrency):
    """The engine's generation before issue #21 (``EmbeddedEngine._generate_batch`` at 3e5c748): a grown cache,
    the mask concatenated and the logits brought to the host every step, a Python loop over the rows."""
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.seed is not None else None
    out = []
    for i in range(0, len(requests), max_concurrency):
        batch = requests[i:i + max_concurrency]
        B, L = len(batch), max(len(r.prompt_ids) for r in batch)
        ids = torch.full((B, L), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, r in enumerate(batch):
            n = len(r.prompt_ids)
            ids[b, L - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, L - n:] = 1
        stops = {tokenizer.eos_id, *sampling.stop_token_ids}
        cache = model.init_cache(B)
        logits = model(ids, cache=cache, attention_mask=mask)[:, -1]
        tokens, logps = [[] for _ in range(B)], [[] for _ in range(B)]
        done, finish = [False] * B, ["length"] * B
        for step in range(sampling.max_new_tokens):
            tok, lp = sample_next(logits.cpu(), sampling.temperature, sampling.top_p, gen)
            for b in range(B):
                if done[b]:
                    continue
                t = int(tok[b])
                tokens[b].append(t)
                logps[b].append(float(lp[b]))
                if t in stops:
                    done[b], finish[b] = True, "stop"
            if all(done) or step == sampling.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
            logits = model(tok[:, None], cache=cache, attention_mask=mask)[:, -1]
        out.extend(Sample(list(r.prompt_ids), tokens[b], tokenizer.decode(tokens[b]), logps[b], finish[b], 0)
                   for b, r in enumerate(batch))
    return out


@pytest.fixture(scope="module")
def reference(model):
    reqs = [GenerateRequest(p) for p in PROMPTS]
    return {name: reference_generate(model, ByteTokenizer(), reqs, sp, 2) for name, sp in CONFIGS.items()}


def test_the_reference_loop_is_the_engine_before_the_change(reference):
    for name, samples in reference.items():
        assert [(s.tokens, s.finish_reason) for s in samples] == RECORDED[name]


@pytest.mark.parametrize("interval", [1, 3, 16])
@pytest.mark.parametrize("mode", ["static", "eager", "window"])
def test_every_mode_gives_the_reference_outputs(model, reference, mode, interval):
    engine = EmbeddedEngine(model, ByteTokenizer(), max_concurrency=2,
                            decode=DecodeSettings(mode=mode, stop_check_interval=interval))
    assert engine.decode_plan.mode == mode
    for name, sp in CONFIGS.items():
        got = engine.generate([GenerateRequest(p) for p in PROMPTS], sp)
        for g, r in zip(got, reference[name]):
            assert (g.tokens, g.finish_reason, g.text) == (r.tokens, r.finish_reason, r.text), (name, mode)
            if mode == "window":  # the absorbed MLA form: float32 rounding, not bits
                assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < 1e-5
            else:
                assert g.logprobs == r.logprobs, (name, mode)


def test_the_default_on_cpu_is_the_static_cache(model):
    engine = EmbeddedEngine(model, ByteTokenizer())
    plan = engine.decode_plan
    assert (plan.mode, plan.sampler, plan.stop_check_interval) == ("static", "torch", 16)
    assert "static" in plan.describe() and "every 16 steps" in plan.describe()


# ------------------------------------------------------------------------------------------------ the loop
class _Scripted:
    """A stepper whose logits put all mass on a scripted token per row and step (one-hot at +50)."""

    def __init__(self, script, vocab=16):
        self.script, self.vocab, self.t, self.steps = script, vocab, 0, 0

    def _logits(self):
        out = torch.full((len(self.script), self.vocab), -50.0)
        for b, row in enumerate(self.script):
            out[b, row[min(self.t, len(row) - 1)]] = 50.0
        return out

    def prefill(self, ids, mask):
        return self._logits()

    def step(self, tokens):
        self.t += 1
        self.steps += 1
        return self._logits()


def test_the_loop_stops_at_the_first_check_after_every_row_stopped_and_trims_each_row():
    # row 0 stops (token 9) at step 2, row 1 at step 5; tokens after a stop keep coming and are cut
    script = [[1, 2, 9, 3, 3, 3, 3, 3, 3, 3], [4, 4, 4, 4, 4, 9, 9, 5, 5, 5]]
    stepper = _Scripted(script)
    sp = SamplingParams(temperature=0, max_new_tokens=10)
    res = decode_batch(stepper, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), sp,
                       torch.tensor([9]), None, stop_check_interval=4)
    assert res.tokens == [[1, 2, 9], [4, 4, 4, 4, 4, 9]] and res.finish_reasons == ["stop", "stop"]
    assert stepper.steps == 7  # sampled steps 0..7: all stopped at 5, seen at the check after step 7
    assert [len(x) for x in res.logprobs] == [3, 6] and all(abs(v) < 1e-6 for x in res.logprobs for v in x)
    # a row that never stops runs to the length limit
    res = decode_batch(_Scripted([[1], [9]]), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                       SamplingParams(temperature=0, max_new_tokens=5), torch.tensor([9]), None, 2)
    assert res.tokens == [[1] * 5, [9]] and res.finish_reasons == ["length", "stop"]


@pytest.mark.parametrize("interval", [1, 4, 16])
def test_the_draws_after_the_last_stop_are_given_back(interval):
    script = [[1, 2, 9] + [3] * 20, [4, 4, 4, 4, 4, 9] + [5] * 20]
    gen = torch.Generator().manual_seed(5)
    res = decode_batch(_Scripted(script), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                       SamplingParams(temperature=1.0, seed=5, max_new_tokens=20), torch.tensor([9]), gen, interval)
    assert res.tokens == [[1, 2, 9], [4, 4, 4, 4, 4, 9]]
    expected = torch.Generator().manual_seed(5)  # what the per-token loop drew: one batch-wide draw per step 0..5
    for _ in range(6):
        torch.multinomial(torch.full((2, 16), 1 / 16), 1, generator=expected)
    assert torch.equal(gen.get_state(), expected.get_state())


class _CountSyncs(TorchDispatchMode):
    """Scalar reads from tensors (``item``, ``bool``, ``int``: aten ``_local_scalar_dense``), by the k3 line that made
    them, leaving out grouped_mm's input check, which runs on CPU only (on CUDA it is skipped to avoid the sync)."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            where, frame = None, sys._getframe(1)
            while frame is not None:
                name = frame.f_code.co_filename
                if name.endswith("kernels/grouped_mm.py"):
                    break
                if where is None and "/k3/" in name:
                    where = f"{name.split('/k3/')[-1]}:{frame.f_lineno}"
                frame = frame.f_back
            else:
                self.where[where or "?"] += 1
        return func(*args, **(kwargs or {}))


def test_a_40_token_decode_syncs_once_per_check(model, monkeypatch):
    interval = 8
    transfers = collections.Counter()
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            transfers[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    sp = SamplingParams(temperature=1.0, seed=1, max_new_tokens=40)
    reqs = [GenerateRequest([5, 6, 7]), GenerateRequest([9, 10])]
    counts = {}
    for mode in ("static", "window", "eager"):
        engine = EmbeddedEngine(model, ByteTokenizer(), decode=DecodeSettings(mode=mode, stop_check_interval=interval))
        engine.generate(reqs, SamplingParams(temperature=1.0, seed=1, max_new_tokens=2))  # allocate the cache
        transfers.clear()
        with _CountSyncs() as syncs:
            samples = engine.generate(reqs, sp)
        assert all(len(s.tokens) == 40 for s in samples)
        counts[mode] = (sum(syncs.where.values()), dict(syncs.where), dict(transfers))
    prefill = 11  # the prompt's checks in forward() (ids range, mask) and the chunked KDA's, once per batch
    for mode in ("static", "window"):
        n, where, moved = counts[mode]
        assert n <= 40 // interval + prefill, (mode, where)
        assert moved.get("tolist", 0) <= 3 and moved.get("cpu", 0) == 0 and moved.get("numpy", 0) == 0, moved
    assert counts["eager"][0] >= 4 * 40  # the reference checks its inputs every step: the counter sees syncs


# ------------------------------------------------------------------------------------------------ memory
def test_kv_cache_release_frees_the_static_cache_and_resume_brings_it_back(model):
    engine = EmbeddedEngine(model, ByteTokenizer(), max_concurrency=2)
    reqs, sp = [GenerateRequest(p) for p in PROMPTS], CONFIGS["sampled"]
    assert engine.decode_cache_bytes() == 0  # nothing before the first call
    first = engine.generate(reqs, sp)
    held = engine.decode_cache_bytes()
    cache = engine._memory.cache
    assert held > 0 and cache.batch_size == 2 and cache.max_len == 256  # prompt 7 + 12 tokens, rounded up
    engine.release_memory(["kv_cache", "cuda_graph"])
    assert engine.decode_cache_bytes() == 0 and engine._memory.cache is None
    with pytest.raises(EngineStateError, match="kv_cache"):
        engine.generate(reqs, sp)
    engine.resume_memory(["kv_cache"])
    with pytest.raises(EngineStateError, match="cuda_graph"):
        engine.generate(reqs, sp)
    engine.resume_memory(["cuda_graph"])
    assert engine.decode_cache_bytes() == held  # allocated again at its last size, before any call
    again = engine.generate(reqs, sp)
    assert [(s.tokens, s.logprobs) for s in again] == [(s.tokens, s.logprobs) for s in first]
    assert engine._memory.cache.max_len == 256
    engine.shutdown()
    assert engine.decode_cache_bytes() == 0


def test_the_cache_grows_for_a_longer_call_and_is_reused_for_a_shorter_one(model):
    engine = EmbeddedEngine(model, ByteTokenizer(), max_concurrency=4)
    engine.generate([GenerateRequest([5, 6])], SamplingParams(temperature=0, max_new_tokens=4))
    assert (engine._memory.cache.batch_size, engine._memory.cache.max_len) == (1, 256)
    engine.generate([GenerateRequest(p) for p in PROMPTS], SamplingParams(temperature=0, max_new_tokens=250))
    assert (engine._memory.cache.batch_size, engine._memory.cache.max_len) == (3, 512)  # 7 + 250 > 256
    cache = engine._memory.cache
    engine.generate([GenerateRequest([5, 6])], SamplingParams(temperature=0, max_new_tokens=4))
    assert engine._memory.cache is cache


def test_padded_rows_of_a_window_batch_change_nothing(model):
    """A graph runs a batch in a bucket of more rows; the dummy rows must not touch the real ones (CPU: eager)."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (torch.arange(5)[None] >= torch.tensor([[2], [0]])).long()
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    results = []
    for rows in (2, 4):
        cache = model.init_static_cache(rows, 16)
        stepper = WindowStepper(model, cache, [3, 5], 0, mla_decode_masked)
        with torch.no_grad():
            results.append(decode_batch(stepper, ids, mask, sp, torch.tensor([2]), None, 4))
    assert results[0].tokens == results[1].tokens
    for a, b in zip(results[0].logprobs, results[1].logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


# ------------------------------------------------------------------------------------------------ settings
def test_bad_decode_settings_are_refused():
    with pytest.raises(ValueError, match="mode='fast'"):
        DecodeSettings(mode="fast")
    with pytest.raises(ValueError, match="mla_kernel"):
        DecodeSettings(mla_kernel="triton")
    with pytest.raises(ValueError, match="sampler"):
        DecodeSettings(sampler="numpy")
    with pytest.raises(ValueError, match="stop_check_interval=0"):
        DecodeSettings(stop_check_interval=0)
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        DecodeSettings(graph_batch_sizes=(8, 4))


def test_impossible_explicit_choices_are_refused_with_the_reason(model):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        resolve_decode(DecodeSettings(mode="graph"), cpu, model)
    with pytest.raises(ValueError, match="window modes"):
        resolve_decode(DecodeSettings(mode="static", mla_kernel="flashinfer"), cpu, model)
    if not fi.flashinfer_available("cuda"):
        with pytest.raises(ValueError, match="flashinfer-python==0.6.15.post1"):
            resolve_decode(DecodeSettings(mode="window", mla_kernel="flashinfer"), torch.device("cuda"), model)
        with pytest.raises(ValueError, match="sampler flashinfer"):
            resolve_decode(DecodeSettings(sampler="flashinfer"), torch.device("cuda"), model)


def test_auto_on_cuda_takes_graphs_and_says_what_it_left_out():
    """Resolution only reads the device's type: checked here for a CUDA device without one."""
    model = _model()
    plan = resolve_decode(DecodeSettings(), torch.device("cuda"), model)
    assert plan.mode == "graph" and plan.bucket(3) == 4 and plan.bucket(64) == 64 and plan.bucket(65) == 65
    if not fi.flashinfer_available("cuda"):
        assert (plan.mla_kernel, plan.sampler) == ("torch", "torch")  # float32 model, no flashinfer here
        assert any("MLA attention torch" in n for n in plan.notes)
    mla = next(m for m in model.modules() if isinstance(m, MLAttention))
    mla.kv_b_proj = type("Adapted", (torch.nn.Linear,), {})(mla.kv_b_proj.in_features, mla.kv_b_proj.out_features,
                                                            bias=False)
    plan = resolve_decode(DecodeSettings(), torch.device("cuda"), model)
    assert plan.mode == "static" and any("kv_b_proj" in n for n in plan.notes)
    with pytest.raises(ValueError, match="kv_b_proj"):
        resolve_decode(DecodeSettings(mode="window"), torch.device("cpu"), model)


def test_rmsnorm_and_situ_kernels_are_resolved_for_the_window_modes(monkeypatch):
    """small_ops: auto takes the Triton kernels in the window modes on CUDA where Triton runs, and says why not
    where it does not; the reference modes and the CPU keep torch; an explicit triton that cannot run is refused.
    Resolution reads the device's type and Triton's availability, faked here."""
    import k3.rollout.embedded.decode_plan as decode_plan

    model, cuda, cpu = _model(), torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(decode_plan, "triton_runs_on", lambda device: torch.device(device).type == "cuda")
    plan = resolve_decode(DecodeSettings(), cuda, model)
    assert (plan.mode, plan.small_ops) == ("graph", "triton")
    assert "small ops triton" in plan.describe()
    assert resolve_decode(DecodeSettings(mode="window", small_ops="torch"), cuda, model).small_ops == "torch"
    assert resolve_decode(DecodeSettings(mode="static"), cuda, model).small_ops == "torch"
    assert resolve_decode(DecodeSettings(), cpu, model).small_ops == "torch"
    assert resolve_decode(DecodeSettings(mode="window"), cpu, model).small_ops == "torch"
    with pytest.raises(ValueError, match=r"^small_ops triton runs in the window modes \(window, graph\), not in "
                                         r"mode static$"):
        resolve_decode(DecodeSettings(mode="static", small_ops="triton"), cuda, model)
    with pytest.raises(ValueError, match=r"^small_ops triton: needs a CUDA device with Triton, the engine runs on "
                                         r"cpu$"):
        resolve_decode(DecodeSettings(mode="window", small_ops="triton"), cpu, model)
    monkeypatch.setattr(decode_plan, "triton_runs_on", lambda device: False)  # CUDA without Triton
    plan = resolve_decode(DecodeSettings(), cuda, model)
    assert plan.small_ops == "torch" and "small ops torch: Triton does not import" in plan.notes
    with pytest.raises(ValueError, match="and Triton does not import$"):
        resolve_decode(DecodeSettings(small_ops="triton"), cuda, model)
    with pytest.raises(ValueError, match=r"DecodeSettings.small_ops='fused': expected one of auto, torch, triton"):
        DecodeSettings(small_ops="fused")


def _k3_latent():
    """The tiny variant with K3's MLA latent (kv_lora_rank 512, rope 64): the one shape flashinfer's MLA kernel has."""
    return variant("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64)


def test_flashinfer_mla_is_taken_only_for_the_latent_shape_it_is_built_for(monkeypatch):
    """The tiny variant's latent (16 + 8) would JIT-build for minutes and fail (seen on the H200): auto leaves it to
    torch and says why, an explicit choice is refused; K3's 512 + 64 takes flashinfer. Resolution reads only the
    device's type and flashinfer's availability, faked here."""
    import k3.rollout.embedded.decode_plan as decode_plan

    monkeypatch.setattr(decode_plan, "flashinfer_missing", lambda device: None)
    monkeypatch.setattr(decode_plan, "triton_runs_on", lambda device: True)
    cuda = torch.device("cuda")
    tiny = _model().to(torch.bfloat16)
    plan = resolve_decode(DecodeSettings(), cuda, tiny)
    assert (plan.mode, plan.mla_kernel, plan.sampler) == ("graph", "torch", "flashinfer")
    assert any("(kv_lora_rank, qk_rope_head_dim) (512, 64) only, the model has (16, 8)" in n for n in plan.notes)
    with pytest.raises(ValueError, match=r"mla_kernel flashinfer: .*the model has \(16, 8\)"):
        resolve_decode(DecodeSettings(mode="window", mla_kernel="flashinfer"), cuda, tiny)
    k3_shaped = _model(cfg=_k3_latent()).to(torch.bfloat16)
    plan = resolve_decode(DecodeSettings(), cuda, k3_shaped)
    assert (plan.mode, plan.mla_kernel, plan.sampler, plan.notes) == ("graph", "flashinfer", "flashinfer", ())


# ------------------------------------------------------------------------------------------------ GPU
def _gpu_model(cfg=None):
    """The tiny model in BF16 on CUDA. LoRA rank 8: the experts' rank-r grouped GEMMs then meet torch's native
    kernel's 16-byte rule (rank 4 takes the padded path, which reads the counts on the host: no capture)."""
    return _model(rank=8, cfg=cfg).to("cuda", torch.bfloat16)


# How far (nats) a greedy token may trail the float32 argmax at its position, and its reported log-prob the float32
# one. Measured on this model in BF16 on the CPU (eager and window alike): worst 0.048 and 0.077. A wrong token (a
# bad cache slot, a stale graph input) trails the best by 0.48 nats at the median position (0.38 at the least):
# the tiny model's distribution is flat. Sharpening the head does not help: BF16's error grows with the logits.
GREEDY_TOL_NATS = 0.2


@torch.no_grad()
def _assert_greedy_under_float32(model, samples):
    """Teacher-forced against a float32 copy of ``model``, one forward per sample: every generated token is within
    ``GREEDY_TOL_NATS`` of the best token at its position, and its reported log-prob within the same of the float32
    one. Paths are not compared token for token: in BF16 one flipped near-tie changes the rest of the sequence."""
    ref = copy.deepcopy(model).float()
    worst_gap = worst_logprob = 0.0
    for s in samples:
        n = len(s.prompt_ids)
        logp = torch.log_softmax(ref(torch.tensor([s.prompt_ids + s.tokens], device="cuda"))[0].float(), -1)
        rows = logp[n - 1:n - 1 + len(s.tokens)]
        chosen = rows.gather(1, torch.tensor(s.tokens, device="cuda")[:, None])[:, 0]
        worst_gap = max(worst_gap, (rows.max(-1).values - chosen).max().item())
        worst_logprob = max(worst_logprob, (chosen.cpu() - torch.tensor(s.logprobs)).abs().max().item())
    assert worst_gap <= GREEDY_TOL_NATS and worst_logprob <= GREEDY_TOL_NATS, (worst_gap, worst_logprob)


def _greedy(engine):
    reqs = [GenerateRequest(p) for p in PROMPTS * 3]
    return engine.generate(reqs, SamplingParams(temperature=0, max_new_tokens=48))


@pytest.mark.gpu
def test_cuda_graph_decode_gives_eager_greedy_tokens():
    model = _gpu_model()
    eager = _greedy(EmbeddedEngine(model, ByteTokenizer(), device="cuda", decode=DecodeSettings(mode="eager")))
    engine = EmbeddedEngine(model, ByteTokenizer(), device="cuda",
                            decode=DecodeSettings(mode="graph", mla_kernel="torch", sampler="torch"))
    graph = _greedy(engine)
    assert engine._graph_off is None  # captured, not fallen back
    _assert_greedy_under_float32(model, eager)
    _assert_greedy_under_float32(model, graph)
    engine.release_memory(["cuda_graph"])
    assert not engine._memory._graphs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["window", "graph"])
def test_fused_rmsnorm_and_situ_decode_gives_eager_greedy_tokens(mode):
    """The small ops (RMSNorm, SiTU, the AttnRes mix, KDA's head norms) as one Triton kernel each, captured into the
    graph in graph mode: the probe passes and the greedy tokens are the model's under float32, as the plain ops'
    are."""
    model = _gpu_model()
    engine = EmbeddedEngine(model, ByteTokenizer(), device="cuda",
                            decode=DecodeSettings(mode=mode, mla_kernel="torch", sampler="torch", small_ops="triton"))
    assert engine.decode_plan.small_ops == "triton"
    got = _greedy(engine)
    assert engine._small_ops_off is None and engine._graph_off is None
    _assert_greedy_under_float32(model, got)


@pytest.mark.gpu
@pytest.mark.skipif(not fi.flashinfer_available("cuda"), reason="flashinfer is not installed")
@pytest.mark.parametrize("mode", ["window", "graph"])
def test_flashinfer_decode_gives_eager_greedy_tokens(mode):
    model = _gpu_model(_k3_latent())
    eager = _greedy(EmbeddedEngine(model, ByteTokenizer(), device="cuda", decode=DecodeSettings(mode="eager")))
    engine = EmbeddedEngine(model, ByteTokenizer(), device="cuda",
                            decode=DecodeSettings(mode=mode, mla_kernel="flashinfer", sampler="flashinfer"))
    got = _greedy(engine)
    assert engine._flashinfer_off is None and engine._graph_off is None
    _assert_greedy_under_float32(model, eager)
    _assert_greedy_under_float32(model, got)


@pytest.mark.gpu
def test_graph_decode_syncs_once_per_check_on_cuda():
    engine = EmbeddedEngine(_gpu_model(), ByteTokenizer(), device="cuda",
                            decode=DecodeSettings(mode="graph", mla_kernel="torch", sampler="torch"))
    reqs = [GenerateRequest(p) for p in PROMPTS]
    sp = SamplingParams(temperature=1.0, seed=3, max_new_tokens=64)
    engine.generate(reqs, sp)  # capture
    with _CountSyncs() as syncs:
        engine.generate(reqs, sp)
    assert sum(syncs.where.values()) <= 64 // 16 + 11, dict(syncs.where)


@pytest.mark.gpu
def test_kv_cache_release_returns_device_memory():
    engine = EmbeddedEngine(_gpu_model(), ByteTokenizer(), device="cuda")
    engine.generate([GenerateRequest(p) for p in PROMPTS], SamplingParams(temperature=0, max_new_tokens=8))
    held = engine.decode_cache_bytes()
    before = torch.cuda.memory_allocated()
    engine.release_memory(["kv_cache", "cuda_graph"])
    assert before - torch.cuda.memory_allocated() >= held


def test_a_failed_graph_capture_falls_back_to_the_eager_window_said_once(model, reference, caplog):
    """Forced onto the CPU, the capture fails for real (no CUDA): logged once, the batch decodes without graphs."""
    import dataclasses

    engine = EmbeddedEngine(model, ByteTokenizer(), max_concurrency=2, decode=DecodeSettings(mode="window"))
    engine.decode_plan = dataclasses.replace(engine.decode_plan, mode="graph")
    with caplog.at_level("WARNING", logger="k3.rollout.embedded.engine"):
        for _ in range(2):
            got = engine.generate([GenerateRequest(p) for p in PROMPTS], CONFIGS["greedy"])
            assert [s.tokens for s in got] == [s.tokens for s in reference["greedy"]]
    assert engine._graph_off  # why: here torch's CUDA graph pool does not exist on a CPU build
    assert [r.message.count("CUDA graph capture failed") for r in caplog.records] == [1]
    assert not engine._memory._graphs


def test_flashinfer_failing_at_first_use_falls_back_to_torch_attention(model, reference, caplog):
    import dataclasses

    engine = EmbeddedEngine(model, ByteTokenizer(), max_concurrency=2, decode=DecodeSettings(mode="window"))
    engine.decode_plan = dataclasses.replace(engine.decode_plan, mla_kernel="flashinfer")
    with caplog.at_level("WARNING", logger="k3.rollout.embedded.engine"):
        got = engine.generate([GenerateRequest(p) for p in PROMPTS], CONFIGS["sampled"])
    assert [s.tokens for s in got] == [s.tokens for s in reference["sampled"]]
    assert engine._flashinfer_off and "flashinfer" in caplog.text
