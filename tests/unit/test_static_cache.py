"""StaticK3Cache against the grown K3Cache: the same logits to the bit on CPU (float32) through a prefill and
several steps with left padding, in place (no cache tensor re-allocated), the absorbed window step within float32
noise, and the bad inputs refused."""

import pytest
import torch
from torch import nn

from k3.config import variant
from k3.kernels.mla_decode.naive import mla_decode_masked
from k3.model import KimiK3ForCausalLM
from k3.model.cache import StaticK3Cache, StaticMLALayerState
from k3.model.mla import MLAttention


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return KimiK3ForCausalLM(variant("tiny")).eval()


def _prompts(lens, seed=1):
    L = max(lens)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lens), L, dtype=torch.long)
    mask = torch.zeros(len(lens), L, dtype=torch.long)
    for b, n in enumerate(lens):  # left padding, as the engine builds its batches
        ids[b, L - n:] = torch.randint(3, 500, (n,), generator=g)
        mask[b, L - n:] = 1
    return ids, mask


def _decode(model, lens, steps, extra=8):
    """Greedy through the grown cache, the static cache at host positions and at its device position."""
    ids, mask = _prompts(lens)
    B, L = ids.shape
    grown, host, window = (model.init_cache(B), model.init_static_cache(B, L + extra),
                           model.init_static_cache(B, L + extra))
    out = {"grown": [], "host": [], "window": []}
    with torch.no_grad():
        a = model(ids, cache=grown, attention_mask=mask)[:, -1]
        out["grown"].append(a)
        out["host"].append(model(ids, cache=host, attention_mask=mask)[:, -1])
        out["window"].append(model(ids, cache=window, attention_mask=mask)[:, -1])
        for _ in range(steps):
            tok = a.argmax(-1)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            a = model(tok[:, None], cache=grown, attention_mask=mask)[:, -1]
            out["grown"].append(a)
            out["host"].append(model.decode_step(tok, host))
            out["window"].append(model.decode_step(tok, window, mla_attention=mla_decode_masked))
            window.note_device_step()
    return out, (grown, host, window)


@pytest.mark.parametrize("lens", [[5, 2, 7], [4, 4], [6]], ids=["left-padded", "no-padding", "one-row"])
def test_static_cache_gives_the_grown_caches_logits_to_the_bit(model, lens):
    out, (grown, host, window) = _decode(model, lens, steps=6)
    for a, b in zip(out["grown"], out["host"]):
        assert torch.equal(a, b)
    # the absorbed form over the whole window: the same math, rounded differently (float32)
    for a, c in zip(out["grown"], out["window"]):
        torch.testing.assert_close(c, a, atol=2e-6, rtol=1e-5)
    assert host.seen_tokens == window.seen_tokens == grown.seen_tokens
    assert int(window.position) == int(host.position) == grown.seen_tokens
    # the same cached state: KDA carries equal, and the static latents are the grown ones after the norm
    for g, h in zip(grown.layers, host.layers):
        if isinstance(h, StaticMLALayerState):
            n = grown.seen_tokens
            assert torch.equal(h.kpe[:, :n], g.latent[..., -h.kpe.shape[-1]:])
        else:
            for x, y in zip(g.tensors(), h.tensors()):
                assert torch.equal(x, y)


def test_a_step_writes_in_place(model):
    ids, mask = _prompts([3, 5])
    cache = model.init_static_cache(2, 16)
    pointers = [t.data_ptr() for s in cache.layers for t in s.tensors()] + [cache.key_mask.data_ptr()]
    with torch.no_grad():
        logits = model(ids, cache=cache, attention_mask=mask)[:, -1]
        for _ in range(3):
            logits = model.decode_step(logits.argmax(-1), cache)
        for _ in range(3):
            logits = model.decode_step(logits.argmax(-1), cache, mla_attention=mla_decode_masked)
            cache.note_device_step()
    assert [t.data_ptr() for s in cache.layers for t in s.tensors()] + [cache.key_mask.data_ptr()] == pointers
    assert cache.seen_tokens == 5 + 6 and int(cache.position) == 11
    # the mask: left padding of row 0 stays False, every written column True, the rest False
    expected = torch.zeros(2, 16, dtype=torch.bool)
    expected[0, 2:11] = True
    expected[1, :11] = True
    assert torch.equal(cache.key_mask, expected)


def test_rows_view_shares_storage_and_reset_empties(model):
    cache = model.init_static_cache(4, 8)
    view = cache.rows(2)
    ids, mask = _prompts([3, 2])
    with torch.no_grad():
        model(ids, cache=view, attention_mask=mask)
    mla = next(s for s in cache.layers if isinstance(s, StaticMLALayerState))
    assert mla.ckv[:2, :3].abs().sum() > 0 and mla.ckv[2:].abs().sum() == 0
    assert cache.seen_tokens == view.seen_tokens == 3 and not view.all_real
    view.reset()
    assert view.seen_tokens == 0 and int(view.position) == 0 and view.all_real
    assert all(t.abs().sum() == 0 for s in cache.layers for t in s.tensors()) and not cache.key_mask.any()
    assert cache.nbytes() == sum(t.numel() * t.element_size() for s in cache.layers for t in s.tensors()) + 32
    with pytest.raises(ValueError, match="rows"):
        cache.rows(5)


def test_bad_inputs_are_refused(model):
    with pytest.raises(ValueError, match="batch_size"):
        model.init_static_cache(0, 8)
    with pytest.raises(ValueError, match="max_len"):
        model.init_static_cache(1, 0)
    cache = model.init_static_cache(1, 4)
    ids, mask = _prompts([3])
    with torch.no_grad():
        model(ids, cache=cache, attention_mask=mask)
        with pytest.raises(ValueError, match="no room for 2 more"):
            model(torch.tensor([[5, 6]]), cache=cache, attention_mask=torch.ones(1, 5, dtype=torch.long))
        model.decode_step(torch.tensor([7]), cache)
        with pytest.raises(ValueError, match="full"):
            model.decode_step(torch.tensor([7]), cache)
        with pytest.raises(ValueError, match=r"tokens \(2,\)"):
            model.decode_step(torch.tensor([7, 8]), model.init_static_cache(1, 4))
        with pytest.raises(TypeError, match="StaticK3Cache"):
            model.decode_step(torch.tensor([7]), model.init_cache(1))


def test_the_absorbed_step_refuses_an_adapted_kv_b(model):
    class Adapted(nn.Linear):  # any subclass adds to the weight's product: absorbing the weight alone would be wrong
        pass

    mla = next(m for m in model.modules() if isinstance(m, MLAttention))
    w_uk, w_uv = mla.absorbed_kv_b()
    assert w_uk.shape == (mla.num_heads, mla.nope_dim, mla.kv_lora_rank)
    assert w_uv.shape == (mla.num_heads, mla.v_dim, mla.kv_lora_rank)
    original = mla.kv_b_proj
    adapted = Adapted(original.in_features, original.out_features, bias=False)
    mla.kv_b_proj = adapted
    try:
        with pytest.raises(ValueError, match="kv_b_proj is a Adapted"):
            mla.absorbed_kv_b()
    finally:
        mla.kv_b_proj = original


def test_static_cache_is_exported_beside_the_grown_one():
    from k3.model import StaticK3Cache as exported

    assert exported is StaticK3Cache
