"""The megatron backend on one CUDA GPU, *without* the CPU compatibility module (megatron's own CUDA paths,
NCCL, the all-to-all dispatcher): tiny K3 and a wider K3 slice on TP1 == the reference model, and LoRA
training steps through megatron's DDP, optimizer and schedule.

Each check runs in a fresh worker process (this file as a script) so megatron's global state never leaks
into the test session.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def _wide_config():
    """A K3 slice at wider shapes: real head dims (KDA 128, MLA 128 + 64 / 128), the first four layer kinds
    (KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE), 32 experts top-4 in a latent narrower than the hidden size."""
    from k3.config import variant

    return variant("4layer").replace(
        quantization_config=None, vocab_size=4096, hidden_size=1024, intermediate_size=2048,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256,
        num_experts=32, num_experts_per_token=4, moe_intermediate_size=256, routed_expert_hidden_size=512,
        linear_attn_config={"num_heads": 8, "head_dim": 128, "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    )


def _reference(cfg, dtype):
    """The reference model on the GPU, AttnRes pseudo-queries made non-zero (scores of std ~2 per mix)."""
    from k3.model import KimiK3ForCausalLM

    torch.manual_seed(0)
    ref = KimiK3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "res_proj" in name:
                p.normal_(0.0, 2.0 / cfg.hidden_size**0.5)
    return ref.to(device="cuda", dtype=dtype)


def _megatron(cfg, ref, dtype, dispatcher="alltoall", **overrides):
    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.model import k3_model_provider

    model = k3_model_provider(k3_transformer_config(cfg, params_dtype=dtype, dispatcher=dispatcher,
                                                    perform_initialization=False, **overrides)).cuda()
    load_hf_state_dict(model, ref.state_dict(), cfg)
    return model


def _logits_check(which: str) -> dict:
    from k3.config import variant
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.parallel import init_parallel

    init_parallel(ParallelLayout.model_parallel())
    cfg = variant("tiny").replace(quantization_config=None) if which == "tiny" else _wide_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    logits = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ref = _reference(cfg, dtype)
        model = _megatron(cfg, ref, dtype)
        with torch.no_grad():
            logits[name] = ref(ids).float(), model(ids, None, None).float()
        del ref, model

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    exact = logits["fp32"][0]
    return {"fp32_rel": rel(logits["fp32"][1], exact),
            "bf16_reference_rel": rel(logits["bf16"][0], exact),  # the reference's own bf16 error
            "bf16_megatron_rel": rel(logits["bf16"][1], exact)}


def _train_check() -> dict:
    from k3.config import variant
    from k3.lora import LoRAConfig
    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.lora import gather_lora
    from k3.megatron.parallel import init_parallel
    from k3.megatron.training import MicroBatch, build_lora_trainer

    init_parallel(ParallelLayout.model_parallel())
    cfg = variant("tiny").replace(quantization_config=None)
    ref = _reference(cfg, torch.bfloat16)
    base = {k: v.clone() for k, v in ref.state_dict().items()}
    config = k3_transformer_config(cfg, params_dtype=torch.bfloat16, perform_initialization=False)
    trainer = build_lora_trainer(config, LoRAConfig(rank=8, alpha=16), lambda m: load_hf_state_dict(m, base, cfg),
                                 lr=1e-3)
    model = trainer.model[0].module
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = gather_lora(model)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=gen)
    batch = [MicroBatch(ids[:, :-1], ids[:, 1:], torch.ones(2, 64))]
    losses = [trainer.step(batch)["loss"] for _ in range(3)]
    lora_after = gather_lora(model)
    return {
        "losses": losses,
        "lora_changed": sorted(k for k in lora_after if not torch.equal(lora_after[k], lora_before[k])),
        "lora_names": sorted(lora_after),
        "frozen_changed": sorted(n for n, p in model.named_parameters()
                                 if not p.requires_grad and not torch.equal(p, frozen_before[n])),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


if __name__ == "__main__":
    result = _train_check() if sys.argv[1] == "train" else _logits_check(sys.argv[1])
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the tests
def _run(which: str) -> dict:
    from megatron_compat import run_workers  # only its launcher: the worker does not install the patches

    proc = run_workers([__file__, which], nproc=1, timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_tp1_logits_equal_the_reference_on_gpu(which):
    r = _run(which)
    # float32: the same kernels on both sides; fla's float32 KDA kernels use TF32 dot products, so results
    # agree to ~1e-3, not to float32 rounding.
    assert r["fp32_rel"] < 5e-3, r
    # bf16: megatron's bf16 logits are as close to the float32 ones as the reference's own bf16 logits.
    assert r["bf16_megatron_rel"] < 2 * r["bf16_reference_rel"] + 5e-3, r


def test_lora_training_steps_on_gpu():
    r = _run("train")
    assert all(v == v and abs(v) < 100 for v in r["losses"]), r["losses"]  # finite
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert r["frozen_changed"] == []
    # B starts at zero, so after the steps every factor (A through the B's gradient) has moved.
    assert r["lora_changed"] == r["lora_names"]
    assert r["trainable"] > 0
