"""``k3.lora.digest`` against a pure-Python reference of the same hash, its sensitivity, and the token KL of
``k3.rl.on_policy`` against a float64 torch reference."""

from __future__ import annotations

import hashlib

import pytest
import torch

from k3.lora.digest import _ADD, _M1, _M2, _M3, chunk_digest, tensor_digest, tensor_digests
from k3.rl.on_policy import token_kl

MASK = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def _reference(t: torch.Tensor) -> str:
    """The same digest in Python integers (arithmetic right shift of signed 64-bit words, sums mod 2**64)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    words = t.contiguous().reshape(-1).view(ints).tolist()
    s1 = s2 = 0
    for i, w in enumerate(words):
        x = _signed((w + i * _M1 + _ADD) * _M2)
        x = _signed(x ^ (x >> 31))
        y = _signed(x * _M3)
        y = _signed(y ^ (y >> 29))
        s1, s2 = (s1 + x) & MASK, (s2 + y) & MASK
    return f"{s1:016x}{s2:016x}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_tensor_digest_equals_the_reference(dtype):
    t = torch.randn(37, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert tensor_digest(t) == _reference(t)


def test_one_flipped_bit_or_a_permutation_changes_the_digest():
    t = torch.randn(64, 8).to(torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.int16).view(-1)[100] ^= 1
    assert tensor_digest(flipped) != tensor_digest(t)
    assert tensor_digest(t.flip(0)) != tensor_digest(t)
    assert tensor_digest(t.t().contiguous().t()) == tensor_digest(t)  # layout is not content
    assert tensor_digests([t, flipped]) == [tensor_digest(t), tensor_digest(flipped)]


def test_chunk_digest_covers_names_dtypes_shapes_and_order():
    a, b = torch.ones(2, 3), torch.zeros(3, 2)
    base = chunk_digest([("x", a), ("y", b)])
    want = hashlib.sha256("".join(f"{n}|{t.dtype}|{tuple(t.shape)}|{tensor_digest(t)}\n"
                                  for n, t in (("x", a), ("y", b))).encode()).hexdigest()
    assert base == want
    assert base != chunk_digest([("y", b), ("x", a)])
    assert base != chunk_digest([("x", a.reshape(3, 2)), ("y", b)])
    assert base != chunk_digest([("x", a.double()), ("y", b)])


def test_tensor_digest_refuses_an_unsupported_dtype():
    with pytest.raises(TypeError, match="not supported"):
        tensor_digest(torch.zeros(2, dtype=torch.complex128))


def test_token_kl_equals_the_reference_and_refuses_mismatched_lengths():
    g = torch.Generator().manual_seed(0)
    engine = (-torch.rand(50, generator=g) * 3).tolist()
    trainer = [e + float(d) for e, d in zip(engine, torch.randn(50, generator=g) * 0.1)]
    d = torch.tensor(trainer, dtype=torch.float64) - torch.tensor(engine, dtype=torch.float64)
    assert token_kl(engine, trainer) == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-12)
    assert token_kl(engine, engine) == 0.0 and token_kl([], []) == 0.0
    with pytest.raises(ValueError, match="must score the same tokens"):
        token_kl([0.0], [0.0, 1.0])
