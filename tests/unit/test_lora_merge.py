"""Merging adapters reproduces the adapter forward; unmerging restores the base bit for bit."""

from __future__ import annotations

import pytest
import torch

from k3.config import variant
from k3.lora import LoRAConfig, apply_lora
from k3.lora.merge import is_merged, merge_lora, unmerge_lora
from k3.model import KimiK3ForCausalLM


def _adapted(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = apply_lora(KimiK3ForCausalLM(variant("tiny"), dtype=dtype), LoRAConfig(rank=4, alpha=8))
    with torch.no_grad():  # B = 0 would make the test vacuous
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return m.eval()


def _base_params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" not in n}


def test_merged_forward_matches_the_adapter_forward_fp32():
    m = _adapted()
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        want = m(ids)
        merge_lora(m)
        assert is_merged(m)
        got = m(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(got, KimiK3ForCausalLM(variant("tiny")).eval()(ids))  # the adapters mattered


def test_merge_adds_the_exact_delta_per_module():
    m = _adapted()
    o_proj = m.model.layers[3].self_attn.o_proj
    experts = m.model.layers[2].block_sparse_moe.experts
    w, w1, w2 = o_proj.weight.clone(), experts.w1.clone(), experts.w2.clone()
    merge_lora(m)
    torch.testing.assert_close(o_proj.weight, w + o_proj.scale * o_proj.lora_B @ o_proj.lora_A)
    torch.testing.assert_close(experts.w1[5], w1[5] + experts.scale * experts.w1_lora_B[5] @ experts.w1_lora_A)
    torch.testing.assert_close(experts.w2[5], w2[5] + experts.scale * experts.w2_lora_B @ experts.w2_lora_A[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unmerge_restores_the_base_bit_exactly(dtype):
    m = _adapted(dtype)
    before = _base_params(m)
    ids = torch.randint(0, 512, (1, 5))
    with torch.no_grad():
        out = m(ids)
        merge_lora(m)
        assert any(not torch.equal(p, before[n]) for n, p in _base_params(m).items())
        unmerge_lora(m)
        assert not is_merged(m)
        after = _base_params(m)
        assert all(torch.equal(after[n], before[n]) for n in before)
        assert torch.equal(m(ids), out)


def test_merge_state_errors():
    m = _adapted()
    with pytest.raises(RuntimeError, match="not merged"):
        unmerge_lora(m)
    merge_lora(m)
    with pytest.raises(RuntimeError, match="already merged"):
        merge_lora(m)
    with pytest.raises(ValueError, match="no LoRA"):
        merge_lora(KimiK3ForCausalLM(variant("tiny")))
