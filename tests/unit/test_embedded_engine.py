"""The embedded rollout engine against the reference model: greedy = argmax of full forwards, logprobs = the
trainer's, adapters applied by version, memory tags released and restored."""

import pytest
import torch

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.lora.export import export_chunks
from k3.model import KimiK3ForCausalLM
from k3.rl.trainers.torch import PolicyTrainer
from k3.rl.trainers.trajectory import Trajectory
from k3.rollout.embedded.engine import EmbeddedEngine
from k3.rollout.embedded.sampling import _top_p_filter, sample_next
from k3.rollout.errors import AdapterVersionError, EngineStateError
from k3.rollout.protocol import GenerateRequest, SamplingParams
from k3.tokenizer import ByteTokenizer


def _model(seed=0):
    torch.manual_seed(seed)
    return apply_lora(KimiK3ForCausalLM(variant("tiny")), LoRAConfig(rank=4, alpha=8))


def _randomize_lora(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(_model(), ByteTokenizer(), max_concurrency=3)


PROMPTS = [[5, 40, 41, 42], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def test_greedy_equals_argmax_of_full_forward(engine):
    samples = engine.generate([GenerateRequest(p) for p in PROMPTS],
                              SamplingParams(temperature=0, max_new_tokens=6))
    with torch.no_grad():
        for p, s in zip(PROMPTS, samples):
            seq = list(p)
            for tok, lp in zip(s.tokens, s.logprobs):
                logits = engine.model(torch.tensor([seq]))[0, -1]
                assert tok == int(logits.argmax())
                assert lp == pytest.approx(float(torch.log_softmax(logits.float(), -1)[tok]), abs=1e-5)
                seq.append(tok)


def test_logprobs_equal_trainer_logprobs():
    model = _model(1)
    _randomize_lora(model, 3)
    eng = EmbeddedEngine(model, ByteTokenizer(), max_concurrency=4)
    samples = eng.generate([GenerateRequest(p) for p in PROMPTS], SamplingParams(temperature=1.0, seed=0,
                                                                                  max_new_tokens=8))
    trainer_model = _model(1)
    trainer_model.load_state_dict(model.state_dict())
    pt = PolicyTrainer(trainer_model, pad_id=0)
    lp = pt.log_probs([Trajectory(s.prompt_ids, s.tokens) for s in samples])
    diffs = [abs(a - b) for s, l in zip(samples, lp) for a, b in zip(s.logprobs, l)]
    assert len(diffs) == sum(len(s.tokens) for s in samples)
    assert sum(diffs) / len(diffs) < 1e-4


def test_load_adapter_makes_engine_match_trainer():
    trainer_model = _model(2)
    _randomize_lora(trainer_model, 5)
    eng = EmbeddedEngine(_model(2), ByteTokenizer())
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert not torch.allclose(eng.model(ids), trainer_model(ids), atol=1e-4)
        eng.load_adapter(list(export_chunks(trainer_model, 1, dtype=torch.float32)), 1)
        assert eng.adapter_version() == 1
        torch.testing.assert_close(eng.model(ids), trainer_model(ids), atol=1e-5, rtol=1e-5)


def test_incomplete_or_stale_version_is_refused_and_nothing_changes():
    trainer_model = _model(3)
    _randomize_lora(trainer_model, 6)
    eng = EmbeddedEngine(_model(3), ByteTokenizer())
    before = {n: p.clone() for n, p in eng.model.named_parameters() if "lora" in n}
    chunks = list(export_chunks(trainer_model, 1, dtype=torch.float32))
    with pytest.raises(AdapterVersionError, match="not first…last complete"):
        eng.load_adapter(chunks[:-1], 1)
    with pytest.raises(AdapterVersionError, match="not newer"):
        eng.load_adapter(chunks, 0)
    assert eng.adapter_version() == 0
    for n, p in eng.model.named_parameters():
        if "lora" in n:
            assert torch.equal(p, before[n])


def test_release_and_resume_weights(engine):
    req = [GenerateRequest(PROMPTS[0])]
    sp = SamplingParams(temperature=0, max_new_tokens=4)
    ref = engine.generate(req, sp)[0].tokens
    engine.release_memory(["kv_cache", "weights"])
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(EngineStateError, match="released"):
        engine.generate(req, sp)
    engine.resume_memory(["weights", "kv_cache"])
    assert engine.generate(req, sp)[0].tokens == ref
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory(["vram"])


def test_max_concurrency_batches_give_same_results(engine):
    reqs = [GenerateRequest(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_new_tokens=5)
    one = EmbeddedEngine(engine.model, ByteTokenizer(), max_concurrency=1)
    assert [s.tokens for s in one.generate(reqs, sp)] == [s.tokens for s in engine.generate(reqs, sp)]


def test_stop_on_eos_and_length(engine):
    tok = ByteTokenizer()
    greedy = engine.generate([GenerateRequest(PROMPTS[1])], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 4
    # make the first greedy token a stop token: generation ends right there with reason "stop"
    s = engine.generate([GenerateRequest(PROMPTS[1])],
                        SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=(greedy.tokens[0],)))[0]
    assert s.tokens == greedy.tokens[:1] and s.finish_reason == "stop"
    assert tok.eos_id not in greedy.tokens


def test_sampling_closed_forms():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    tok, lp = sample_next(logits, 0.0, 1.0)
    assert int(tok) == 3 and float(lp) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 3]))
    p = torch.softmax(logits, -1)
    kept = _top_p_filter(p, 0.6)  # 0.644 of mass in the top token alone reaches 0.6
    assert torch.equal(kept > 0, torch.tensor([[False, False, False, True]]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
