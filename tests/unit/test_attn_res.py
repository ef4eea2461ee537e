"""AttnRes: the 93-layer schedule through the real layer protocol, the tiny model instrumented, the mix."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from k3.config import variant
from k3.model import attn_res
from k3.model.attn_res import AttnResBank, attn_res_final, attn_res_layer, attn_res_mix
from k3.model.model import KimiK3ForCausalLM
from k3.model.norm import RMSNorm


class RecordingBank(AttnResBank):
    """Counts candidates per mix and remembers at which layer each push happened."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = -1
        self.pushed_at: list[int] = []
        self.mix_sizes: list[tuple[int, int]] = []  # (layer, candidates)

    def push(self, partial):
        self.pushed_at.append(self.layer)
        super().push(partial)

    def mix(self, partial, norm, proj):
        self.mix_sizes.append((self.layer, len(self.blocks) + 1))
        return super().mix(partial, norm, proj)


def walk(cfg, bank: RecordingBank) -> torch.Tensor:
    """Run ``attn_res_layer`` for every layer of ``cfg`` with stub blocks on a [1, 1, 4] stream."""
    norm, proj = RMSNorm(4, cfg.rms_norm_eps), nn.Linear(4, 1, bias=False)
    nn.init.zeros_(proj.weight)
    partial = torch.ones(1, 1, 4)
    for layer in range(cfg.num_hidden_layers):
        bank.layer = layer
        partial = attn_res_layer(bank, partial, block_start=cfg.is_block_start(layer), attn_res=(norm, proj),
                                 attn=lambda a: a * 0.5, mlp_res=(norm, proj), ffn=lambda m: m * 0.25)
    bank.layer = cfg.num_hidden_layers
    return attn_res_final(bank, partial, norm, proj)


def test_full_schedule_pushes_every_12_layers_and_mixes_9_at_the_end():
    cfg = variant("full")
    bank = RecordingBank()
    walk(cfg, bank)
    assert bank.pushed_at == [0, 12, 24, 36, 48, 60, 72, 84]
    assert cfg.attn_res_block_starts == bank.pushed_at
    final = [n for layer, n in bank.mix_sizes if layer == 93]
    assert final == [9] and cfg.attn_res_final_candidates == 9
    sizes = dict()
    for layer, n in bank.mix_sizes:
        sizes.setdefault(layer, []).append(n)
    assert sizes[0] == [2]  # layer 0: no attention mix (empty bank); the FFN mix sees {embedding, partial}
    assert sizes[1] == [2, 2] and sizes[11] == [2, 2]
    assert sizes[12] == [2, 3]  # attention mix before the push, FFN mix after it
    assert sizes[13] == [3, 3] and sizes[84] == [8, 9] and sizes[92] == [9, 9]


def test_tiny_model_forward_follows_the_schedule(monkeypatch):
    cfg = variant("tiny")
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(cfg)
    expected_bank = RecordingBank()
    walk(cfg, expected_bank)
    calls: list[tuple[str, int]] = []
    real_push, real_mix = AttnResBank.push, AttnResBank.mix

    def push(self, partial):
        calls.append(("push", len(self.blocks)))
        real_push(self, partial)

    def mix(self, partial, norm, proj):
        calls.append(("mix", len(self.blocks) + 1))
        return real_mix(self, partial, norm, proj)

    monkeypatch.setattr(attn_res.AttnResBank, "push", push)
    monkeypatch.setattr(attn_res.AttnResBank, "mix", mix)
    model(torch.randint(0, cfg.vocab_size, (1, 4)))
    pushes = [i for i, (kind, _) in enumerate(calls) if kind == "push"]
    assert len(pushes) == len(cfg.attn_res_block_starts) == 3  # tiny: block 3, 9 layers -> 0, 3, 6
    assert [n for kind, n in calls if kind == "mix"] == [n for _, n in expected_bank.mix_sizes]
    assert calls[-1] == ("mix", cfg.attn_res_final_candidates) == ("mix", 4)


def test_mix_matches_hand_computed_softmax():
    torch.manual_seed(1)
    H, eps = 5, 1e-5
    norm, proj = RMSNorm(H, eps), nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H))
        proj.weight.copy_(torch.randn(1, H))
    cands = [torch.randn(2, 3, H) for _ in range(3)]
    got = attn_res_mix(cands, norm, proj)
    for b in range(2):
        for t in range(3):
            scores = []
            for c in cands:
                v = c[b, t].tolist()
                inv = 1.0 / math.sqrt(sum(x * x for x in v) / H + eps)
                scores.append(sum(v[d] * inv * norm.weight[d].item() * proj.weight[0, d].item() for d in range(H)))
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            w = [x / sum(w) for x in w]
            want = [sum(w[i] * cands[i][b, t, d].item() for i in range(3)) for d in range(H)]
            assert got[b, t].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_zero_pseudo_query_is_a_uniform_average_and_keeps_dtype():
    norm, proj = RMSNorm(4, 1e-5), nn.Linear(4, 1, bias=False)
    nn.init.zeros_(proj.weight)
    cands = [torch.randn(1, 2, 4, dtype=torch.bfloat16) for _ in range(4)]
    got = attn_res_mix(cands, norm, proj)
    assert got.dtype == torch.bfloat16
    want = torch.stack([c.float() for c in cands]).mean(0).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_layer_zero_attention_reads_the_embedding_unmixed():
    cfg = variant("tiny")
    bank, seen = AttnResBank(), []
    norm, proj = RMSNorm(3, 1e-5), nn.Linear(3, 1, bias=False)
    emb = torch.randn(1, 2, 3)
    out = attn_res_layer(bank, emb, block_start=True, attn_res=(norm, proj),
                         attn=lambda a: seen.append(a) or torch.zeros_like(a), mlp_res=(norm, proj),
                         ffn=lambda m: torch.zeros_like(m))
    assert seen[0] is emb and bank.blocks == [emb]
    assert torch.equal(out, torch.zeros_like(emb))  # a block start restarts the partial sum at o = 0
    assert cfg.is_block_start(0)
