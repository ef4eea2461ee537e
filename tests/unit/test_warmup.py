"""Supervised warm-up: the loss falls on a repeated example, the result is a loadable BF16 checkpoint, and the
cache key follows every setting."""

import json

import torch

from k3.config import variant
from k3.model import KimiK3ForCausalLM
from k3.rl.data.arith import warmup_corpus
from k3.rl.warmup import supervised_warmup, warmup_key


def test_warmup_learns_saves_and_keys(tmp_path):
    torch.manual_seed(0)
    KimiK3ForCausalLM(variant("tiny").replace(quantization_config=None)).save_pretrained(tmp_path / "base")
    ex = [(e.prompt, e.completion) for e in warmup_corpus(2, seed=0)]
    stats = supervised_warmup(tmp_path / "base", tmp_path / "warm", ex, steps=30, batch_size=4, lr=3e-3,
                              label_smoothing=0.1)
    assert stats["steps"] == 30 and stats["loss_last"] < 0.7 * stats["loss_first"]
    assert json.loads((tmp_path / "warm" / "warmup.json").read_text())["steps"] == 30
    m = KimiK3ForCausalLM.from_pretrained(tmp_path / "warm")
    assert m.model.embed_tokens.weight.dtype == torch.float32
    assert not list(tmp_path.glob("warm.tmp-*"))  # the temp dir was renamed into place
    k = warmup_key(tmp_path / "base", steps=12)
    assert k == warmup_key(tmp_path / "base", steps=12) != warmup_key(tmp_path / "base", steps=13)


def test_warmup_key_follows_the_weights_not_just_their_names(tmp_path):
    from k3.checkpoint.synth import write_synthetic_checkpoint

    a = write_synthetic_checkpoint(variant("tiny"), tmp_path / "a", "bf16", seed=0, progress=False)
    b = write_synthetic_checkpoint(variant("tiny"), tmp_path / "b", "bf16", seed=1, progress=False)
    for name in ("config.json", "model.safetensors.index.json"):  # same names, shapes and config: only values differ
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert warmup_key(a, steps=1) != warmup_key(b, steps=1)
    assert warmup_key(a, steps=1) == warmup_key(tmp_path / "a", steps=1)
