"""One extra row of the LoRA target table on the megatron backend (CPU, gloo, TP2): the wrapper adapts MLA's
``q_b_proj`` (``tests/lora_extra_target.py``, a column-parallel linear) with no code beyond the row, its factors are
sharded by the row's style, and the logits and the first step's adapter gradients equal the reference model's
with the same adapters (names mapped by ``k3.checkpoint.names``).

The worker (this file run under torchrun) adds the row to its own process's table; the pytest process never does.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

RANK, ALPHA = 4, 8.0
MLA = (3, 7, 8)  # tiny's MLA layers (0-based)
Q_B = "self_attention.q_b_proj"


# ---------------------------------------------------------------------------------------------- the worker
def _worker(out_path: str) -> None:
    import megatron_compat

    megatron_compat.install()
    import torch.distributed as dist
    from lora_extra_target import add_row
    from megatron.core import parallel_state, tensor_parallel

    from k3.checkpoint.names import hf_lora_to_megatron, megatron_lora_to_hf
    from k3.config import variant
    from k3.lora import LoRAConfig, apply_lora, lora_modules
    from k3.lora.export import chunk_layout, load_adapter_tensors
    from k3.lora.linear import LoRALinear
    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.lora import gather_lora, load_lora
    from k3.megatron.parallel import init_parallel
    from k3.megatron.training import MicroBatch, build_lora_trainer
    from k3.model import KimiK3ForCausalLM
    from k3.settings.lora import target_names

    add_row()
    cfg = variant("tiny").replace(quantization_config=None)
    torch.manual_seed(0)
    ref = KimiK3ForCausalLM(cfg)
    sizes = ParallelLayout.model_parallel(tp=2)
    init_parallel(sizes)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=target_names())
    assert Q_B in lora.target_modules
    base = {k: v.clone() for k, v in ref.state_dict().items()}
    config = k3_transformer_config(cfg, sizes, perform_initialization=False)
    trainer = build_lora_trainer(config, lora, lambda m: load_hf_state_dict(m, base, cfg), lr=2e-4, clip_grad=0.0)
    model = trainer.model[0].module
    out: dict = {"local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters() if ".q_b_proj.lora." in n}}

    initial = gather_lora(model)
    peft = {name: torch.zeros(shape) for spec in chunk_layout(cfg, lora) for name, shape in spec.tensors}
    out["coverage_equal"] = sorted(initial) == sorted(hf_lora_to_megatron(peft, cfg))
    out["initial_shapes"] = {k: tuple(v.shape) for k, v in initial.items() if ".q_b_proj." in k}

    gen = torch.Generator().manual_seed(11)  # every B non-zero (else no gradient reaches A), alike on both ranks
    state = {k: (0.05 * torch.randn(v.shape, generator=gen) if k.endswith("lora_B") else v)
             for k, v in sorted(initial.items())}
    load_lora(model, state)
    ref_lora = apply_lora(copy.deepcopy(ref), lora)
    load_adapter_tensors(ref_lora, megatron_lora_to_hf(state, cfg).items(), strict=True)

    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(7))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    mask = torch.ones(2, 16)
    mask[1, 11:] = 0.0
    with torch.no_grad():
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(trainer.model[0](inputs, None, None))
        want = ref_lora(inputs)
        out["logits_err"] = (logits - want).abs().max().item()
        q_b_off = copy.deepcopy(ref_lora)
        for i in MLA:
            q_b_off.model.layers[i].self_attn.q_b_proj.lora_B.zero_()
        out["q_b_effect"] = (want - q_b_off(inputs)).abs().max().item()

    trainer.step([MicroBatch(inputs, labels, mask)])
    grads = gather_lora(model, grads=True)
    # the reference: the same token-mean loss, backward through the adapters
    log_probs = torch.log_softmax(ref_lora(inputs).float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ((-log_probs * mask).sum() / mask.sum()).backward()
    ref_grads = {}
    for path, m in lora_modules(ref_lora):
        if isinstance(m, LoRALinear):  # the linear targets; the routed experts are checked elsewhere
            ref_grads[f"language_model.{path}.lora_A.weight"] = m.lora_A.grad
            ref_grads[f"language_model.{path}.lora_B.weight"] = m.lora_B.grad
    want_grads = hf_lora_to_megatron(ref_grads, cfg)
    out["grads"] = {k: (grads[k], v) for k, v in want_grads.items()}
    parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron_compat import run_workers

    path = tmp_path_factory.mktemp("megatron_lora_row") / "tp2.pt"
    run_workers([__file__, str(path)], nproc=2)
    return torch.load(path)


def test_the_wrapper_adapts_q_b_proj_on_mla_layers_sharded_by_its_style(results):
    from k3.config import variant

    cfg = variant("tiny")
    out = cfg.num_attention_heads * cfg.qk_head_dim
    site = "decoder.layers.{}.self_attention.q_b_proj.lora."
    local = {}
    for i in MLA:
        local[site.format(i) + "q_b_lora_A"] = (RANK, cfg.q_lora_rank)  # replicated
        local[site.format(i) + "q_b_lora_B"] = (out // 2, RANK)  # rows split over TP2
    assert results["local_shapes"] == local
    assert results["initial_shapes"] == {k: (v if k.endswith("A") else (out, RANK)) for k, v in local.items()}
    assert results["coverage_equal"]  # every factor the torch backend's export names, and no other


def test_logits_equal_the_reference_with_the_row(results):
    assert results["q_b_effect"] > 1e-3  # the q_b adapters change the logits ...
    assert results["logits_err"] < 1e-4  # ... as the reference model's do


def test_first_step_gradients_equal_the_reference(results):
    grads = results["grads"]
    assert {k for k in grads if ".q_b_proj." in k} == {
        f"decoder.layers.{i}.self_attention.q_b_proj.lora.q_b_lora_{ab}" for i in MLA for ab in "AB"}
    for name, (got, want) in grads.items():
        assert got.shape == want.shape, name
        rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert rel < 2e-4, f"{name}: relative error {rel:.2e}"  # a missing or doubled TP sum is off by O(1)
