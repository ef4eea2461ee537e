"""MLA decode attention in the latent space (``k3.kernels.mla_decode``): the absorbed form equals plain attention
over the expanded keys and values (closed form, float64), the paged reference equals the dense masked form, bad
shapes are refused, and flashinfer (``gpu``, where it imports) matches the torch reference at K3's MLA shape."""

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.mla_decode import flashinfer as fi
from k3.kernels.mla_decode.naive import mla_decode_masked, mla_decode_paged_reference

K3_HEADS, K3_LATENT, K3_ROPE, K3_NOPE, K3_V = 96, 512, 64, 128, 128


def _inputs(b=3, h=4, T=11, C=16, R=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_latent, q_rope = torch.randn(b, h, C, generator=g, dtype=dtype), torch.randn(b, h, R, generator=g, dtype=dtype)
    ckv, kpe = torch.randn(b, T, C, generator=g, dtype=dtype), torch.randn(b, T, R, generator=g, dtype=dtype)
    return q_latent, q_rope, ckv, kpe


def test_absorbed_form_equals_attention_over_expanded_keys_and_values():
    b, h, T, C, R, nope, v = 2, 3, 9, 16, 8, 12, 10
    g = torch.Generator().manual_seed(1)
    w_uk = torch.randn(h, nope, C, generator=g, dtype=torch.float64)
    w_uv = torch.randn(h, v, C, generator=g, dtype=torch.float64)
    q_nope = torch.randn(b, h, nope, generator=g, dtype=torch.float64)
    _, q_rope, ckv, kpe = _inputs(b, h, T, C, R, seed=2)
    valid = torch.ones(b, T, dtype=torch.bool)
    valid[0, :4] = False  # left padding of row 0
    scale = (nope + R) ** -0.5
    # plain MLA: per-head keys [k_nope | k_rope], values from the latent
    k = torch.cat([torch.einsum("btc,hnc->bhtn", ckv, w_uk), kpe[:, None].expand(b, h, T, R)], -1)
    vals = torch.einsum("btc,hvc->bhtv", ckv, w_uv)
    q = torch.cat([q_nope, q_rope], -1)[:, :, None]
    expected = F.scaled_dot_product_attention(q, k, vals, attn_mask=valid[:, None, None], scale=scale)[:, :, 0]
    q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    o_latent = mla_decode_masked(q_latent, q_rope, ckv, kpe, valid, scale)
    torch.testing.assert_close(torch.einsum("bhc,hvc->bhv", o_latent, w_uv), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page", [1, 4])
def test_paged_reference_equals_the_masked_window(page):
    b, h, T, C, R = 3, 2, 12, 8, 4
    q_latent, q_rope, ckv, kpe = _inputs(b, h, T, C, R, seed=3)
    lens = [12, 5, 9]
    valid = torch.arange(T)[None] < torch.tensor(lens)[:, None]
    dense = mla_decode_masked(q_latent, q_rope, ckv, kpe, valid, 0.3)
    # the rows' pages shuffled through one pool
    n_pages = T // page
    perm = torch.randperm(b * n_pages, generator=torch.Generator().manual_seed(4))
    ckv_pages = torch.empty(b * n_pages, page, C, dtype=ckv.dtype)
    kpe_pages = torch.empty(b * n_pages, page, R, dtype=kpe.dtype)
    ckv_pages[perm] = ckv.reshape(b * n_pages, page, C)
    kpe_pages[perm] = kpe.reshape(b * n_pages, page, R)
    indptr = torch.arange(b + 1) * n_pages
    paged = mla_decode_paged_reference(q_latent, q_rope, ckv_pages, kpe_pages, indptr, perm, torch.tensor(lens), 0.3)
    torch.testing.assert_close(paged, dense, rtol=1e-12, atol=1e-12)


def test_closed_form_one_key_and_equal_scores():
    q_latent, q_rope, ckv, kpe = _inputs(b=1, h=2, T=5)
    one = torch.zeros(1, 5, dtype=torch.bool)
    one[0, 3] = True  # a single visible key: the output is that key's latent for every head
    out = mla_decode_masked(q_latent, q_rope, ckv, kpe, one, 0.7)
    torch.testing.assert_close(out, ckv[:, 3:4].expand(1, 2, ckv.shape[-1]), rtol=0, atol=1e-15)
    zeros_q = torch.zeros_like(q_latent), torch.zeros_like(q_rope)  # equal scores: the mean of the visible latents
    out = mla_decode_masked(*zeros_q, ckv, kpe, torch.ones(1, 5, dtype=torch.bool), 0.7)
    torch.testing.assert_close(out[0, 0], ckv[0].mean(0), rtol=1e-12, atol=1e-12)


def test_bad_shapes_are_refused():
    q_latent, q_rope, ckv, kpe = _inputs()
    valid = torch.ones(3, 11, dtype=torch.bool)
    with pytest.raises(ValueError, match="query widths"):
        mla_decode_masked(q_latent[..., :-1], q_rope, ckv, kpe, valid, 1.0)
    with pytest.raises(ValueError, match="valid"):
        mla_decode_masked(q_latent, q_rope, ckv, kpe, valid[:, :-1], 1.0)
    with pytest.raises(ValueError, match="same batch and heads"):
        mla_decode_masked(q_latent, q_rope[:, :2], ckv, kpe, valid, 1.0)
    pages = ckv.reshape(33, 1, -1), kpe.reshape(33, 1, -1)
    with pytest.raises(ValueError, match="kv_len 12 needs 12 pages"):
        mla_decode_paged_reference(q_latent, q_rope, *pages, torch.tensor([0, 11, 22, 33]), torch.arange(33),
                                   torch.tensor([11, 11, 12]), 1.0)
    with pytest.raises(ValueError, match="expected 4 and 3"):
        mla_decode_paged_reference(q_latent, q_rope, *pages, torch.tensor([0, 11, 22]), torch.arange(33),
                                   torch.tensor([1, 1, 1]), 1.0)


@pytest.mark.skipif(fi.flashinfer_available("cuda"), reason="flashinfer is installed here")
def test_without_flashinfer_every_entry_point_says_what_is_missing():
    assert "CUDA device" in fi.flashinfer_missing("cpu")
    assert fi.FLASHINFER_PIN in fi.flashinfer_missing("cuda")
    assert not fi.flashinfer_available()
    with pytest.raises(RuntimeError, match="flashinfer-python==0.6.15.post1"):
        fi.top_p_sample(torch.full((1, 4), 0.25), 0.9, None)
    with pytest.raises(RuntimeError, match="flashinfer"):
        fi.PagedMLADecode("cuda", 4, 16, 8, page_size=1)


def test_flashinfer_mla_takes_the_k3_latent_shape_only():
    assert fi.mla_shape_problem(512, 64) is None
    why = fi.mla_shape_problem(16, 8)
    assert why == ("flashinfer's MLA kernel is built for (kv_lora_rank, qk_rope_head_dim) (512, 64) only, the model "
                   "has (16, 8)")


# ------------------------------------------------------------------------------------------------ flashinfer, GPU
@pytest.mark.gpu
@pytest.mark.skipif(not fi.flashinfer_available("cuda"), reason="flashinfer is not installed")
@pytest.mark.parametrize("page", [64, 1])
@pytest.mark.parametrize("batch", [8, 64])
def test_flashinfer_mla_matches_the_paged_reference_at_k3_shape(page, batch):
    """BF16, 96 heads, latent 512 + rope 64, up to 1023 cached tokens, shuffled pages: max abs diff < 1e-2 (the
    issue measured 3.9e-3 at batch 64 x 1024 tokens)."""
    dev, dtype = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    lens = torch.randint(1, 1024, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    pages_per = [-(-n // page) for n in lens]
    n_pages = sum(pages_per) + 7
    ckv = torch.randn(n_pages, page, K3_LATENT, device=dev, dtype=dtype, generator=g)
    kpe = torch.randn(n_pages, page, K3_ROPE, device=dev, dtype=dtype, generator=g)
    q_latent = torch.randn(batch, K3_HEADS, K3_LATENT, device=dev, dtype=dtype, generator=g)
    q_rope = torch.randn(batch, K3_HEADS, K3_ROPE, device=dev, dtype=dtype, generator=g)
    indices = torch.randperm(n_pages, device=dev, generator=g)[:sum(pages_per)].to(torch.int32)
    indptr = torch.tensor([0, *pages_per], dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = (K3_NOPE + K3_ROPE) ** -0.5
    kernel = fi.PagedMLADecode(dev, K3_HEADS, K3_LATENT, K3_ROPE, page_size=page)
    kernel.plan(indptr, indices, torch.tensor(lens, dtype=torch.int32), scale, dtype)
    out = kernel.run(q_latent, q_rope, ckv, kpe)
    ref = mla_decode_paged_reference(q_latent.float(), q_rope.float(), ckv.float(), kpe.float(), indptr, indices,
                                     torch.tensor(lens), scale)
    assert (out.float() - ref).abs().max() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not fi.flashinfer_available("cuda"), reason="flashinfer is not installed")
def test_flashinfer_top_p_sampling_stays_in_the_nucleus_and_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], device="cuda").expand(20000, 4).contiguous()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tok = fi.top_p_sample(probs, 0.8, gen)
    assert tok.dtype == torch.int64 and int(tok.max()) <= 1  # the nucleus of 0.8 is {0, 1}
    share = (tok == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.02
    again = fi.top_p_sample(probs, 0.8, torch.Generator(device="cuda").manual_seed(0))
    assert torch.equal(tok, again)  # seeded: reproducible


def test_the_gpu_extra_pins_the_flashinfer_the_errors_name():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert fi.FLASHINFER_PIN in extras["gpu"]
    # cluster leaves flashinfer to sglang's own pin (a second, different pin there could not be resolved)
    assert not any(r.startswith("flashinfer") for r in extras["cluster"])
