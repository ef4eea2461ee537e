"""The megatron backend on CPU (gloo, tests/megatron_compat.py): tiny K3 on megatron TP1 == the reference model,
and TP2, EP2, TP2×EP2 == TP1 (logits, 3 Adam steps of LoRA: losses, every adapter gradient, final adapters);
PP2 (a stage boundary inside an AttnRes block) == TP1 over the same steps.

Two worker runs (this file executed as a script): one process for TP1 and the reference, one 2-rank torchrun
that builds the three layouts in turn. Their results are compared here.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from layout_parity import assert_adapters_equal, assert_gradients_equal, assert_losses_equal

LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "tp2xep2": (2, 2, 1), "pp2": (1, 1, 2)}
STEPS = 3
RANK, ALPHA = 4, 8.0


# ---------------------------------------------------------------------------------------------- the workers
def _reference_and_data():
    """The tiny reference model (AttnRes queries made non-zero so every mix matters) and the micro-batches."""
    from k3.config import variant
    from k3.model import KimiK3ForCausalLM

    cfg = variant("tiny").replace(quantization_config=None)
    torch.manual_seed(0)
    ref = KimiK3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "res_proj" in name:
                p.normal_(0.0, 0.5)
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
        mask = torch.ones(2, 16)
        mask[1, 11:] = 0.0  # right padding on one row
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask))
    return cfg, ref, batches


def _with_random_B(state: dict) -> dict:
    """Fresh adapters have B = 0 (no gradient reaches A); give every B values, the same under every layout."""
    gen = torch.Generator().manual_seed(11)
    return {k: (0.05 * torch.randn(v.shape, generator=gen) if k.endswith("lora_B") else v)
            for k, v in sorted(state.items())}


def _all_stages(part: dict) -> dict:
    """Merge the per-stage dicts of every pipeline stage (names are global)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, part, group=group)
    return {k: v for piece in pieces for k, v in piece.items()}


def _world_max(x: float) -> float:
    """The largest ``x`` over every rank (each CP rank checks its own tokens; rank 0 keeps the results)."""
    import torch.distributed as dist

    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _run_layout(tp: int, ep: int, pp: int, cfg, ref, batches, cp: int = 1) -> dict:
    """One layout's results: logits errors (a whole model only), the adapters before / after, and per step
    the loss and every adapter gradient (merged over stages). Under CP the logits are this rank's tokens."""
    from megatron.core import parallel_state, tensor_parallel

    from k3.checkpoint.names import megatron_lora_to_hf
    from k3.lora import LoRAConfig, apply_lora
    from k3.lora.export import load_adapter_tensors
    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.context_parallel import cp_local_tokens
    from k3.megatron.lora import apply_megatron_lora, gather_lora, load_lora
    from k3.megatron.parallel import init_parallel
    from k3.megatron.training import MicroBatch, build_lora_trainer

    # 9 layers over 2 stages: 4 + 5, so the stage boundary falls inside an AttnRes block (bank of 2 rows)
    sizes = ParallelLayout.model_parallel(tp=tp, ep=ep, pp=pp, cp=cp, first_stage_layers=4 if pp > 1 else None)
    init_parallel(sizes)
    out: dict = {}
    config = k3_transformer_config(cfg, sizes, perform_initialization=False)
    base = {k: v.clone() for k, v in ref.state_dict().items()}
    lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    trainer = build_lora_trainer(config, lora, lambda m: load_hf_state_dict(m, base, cfg), lr=2e-4, clip_grad=0.0)
    model = trainer.model[0].module
    ids = batches[0][0]
    cp_group = parallel_state.get_context_parallel_group()
    local_ids = cp_local_tokens(ids, cp_group)  # this CP rank's tokens (all of them at CP 1)
    whole = pp == 1  # a pipeline stage alone has no logits; PP is checked through the training steps
    if whole:
        with torch.no_grad():
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(trainer.model[0](local_ids, None, None))
            out["base_logits_err"] = _world_max((logits - cp_local_tokens(ref(ids), cp_group)).abs().max().item())
    out["initial"] = _all_stages(gather_lora(model))
    try:
        apply_megatron_lora(model, lora)
    except TypeError as e:
        out["second_apply_error"] = str(e)
    state = _with_random_B(out["initial"])
    load_lora(model, state)  # each stage takes its own layers
    if whole:
        ref_lora = apply_lora(copy.deepcopy(ref), lora)
        load_adapter_tensors(ref_lora, megatron_lora_to_hf(state, cfg).items(), strict=True)
        with torch.no_grad():
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(trainer.model[0](local_ids, None, None))
            want = cp_local_tokens(ref_lora(ids), cp_group)
            out["lora_logits_err"] = _world_max((logits - want).abs().max().item())
            out["lora_logits_effect"] = _world_max((want - cp_local_tokens(ref(ids), cp_group)).abs().max().item())
    # forward-only per-token log-probs of every micro-batch (whole sequences on every stage and CP rank)
    out["log_probs"] = [o.log_probs for o in trainer.forward([MicroBatch(*b) for b in batches])]
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine = [MicroBatch(*b) for b in batches][dp_rank::dp]
    out["loss"], out["grads"] = [], []
    for _ in range(STEPS):
        out["loss"].append(trainer.step(mine)["loss"])
        out["grads"].append(_all_stages(gather_lora(model, grads=True)))
    out["final"] = _all_stages(gather_lora(model))
    parallel_state.destroy_model_parallel()
    return out


def _worker(mode: str, out_path: str) -> None:
    import megatron_compat

    megatron_compat.install()
    import torch.distributed as dist

    cfg, ref, batches = _reference_and_data()
    layouts = {"tp1": (1, 1, 1)} if mode == "tp1" else LAYOUTS
    results = {name: _run_layout(*sizes, cfg, ref, batches) for name, sizes in layouts.items()}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megatron_compat import run_workers

    tmp = tmp_path_factory.mktemp("megatron_parallel")
    run_workers([__file__, "tp1", str(tmp / "tp1.pt")], nproc=1)
    run_workers([__file__, "layouts", str(tmp / "layouts.pt")], nproc=2)
    return {**torch.load(tmp / "tp1.pt"), **torch.load(tmp / "layouts.pt")}


def test_tp1_logits_equal_the_reference_model(results):
    assert results["tp1"]["base_logits_err"] < 1e-5


def test_tp1_lora_logits_equal_the_reference_lora_model(results):
    r = results["tp1"]
    assert r["lora_logits_effect"] > 1e-2  # the adapters change the logits ...
    # ... as the reference's LoRA does (names mapped by k3.checkpoint.names), to float32 rounding of a
    # differently ordered computation (the fused fc1, the grouped expert GEMMs)
    assert r["lora_logits_err"] < 1e-4


@pytest.mark.parametrize("layout", [name for name, (_, _, pp) in LAYOUTS.items() if pp == 1])
def test_layout_logits_equal_the_reference(results, layout):
    assert results[layout]["base_logits_err"] < 2e-5
    assert results[layout]["lora_logits_err"] < 1e-4


def test_adapters_cover_the_recipe_targets_like_the_torch_backend(results):
    from k3.checkpoint.names import hf_lora_to_megatron
    from k3.config import variant
    from k3.lora import LoRAConfig
    from k3.lora.export import chunk_layout

    cfg = variant("tiny").replace(quantization_config=None)
    peft = {name: torch.zeros(shape) for spec in chunk_layout(cfg, LoRAConfig(rank=RANK, alpha=ALPHA))
            for name, shape in spec.tensors}
    expected = hf_lora_to_megatron(peft, cfg)
    got = results["tp1"]["initial"]
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].shape == t.shape, name
        assert bool((got[name] == 0).all()) == name.endswith("lora_B"), name  # B = 0, A random


def test_applying_lora_twice_is_refused(results):
    assert "already carries LoRA adapters" in results["tp1"]["second_apply_error"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_initial_adapters_equal_tp1(results, layout):
    base, got = results["tp1"]["initial"], results[layout]["initial"]
    assert sorted(got) == sorted(base)
    for name in base:
        assert torch.equal(got[name], base[name]), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_forward_log_probs_equal_tp1(results, layout):
    for a, b in zip(results[layout]["log_probs"], results["tp1"]["log_probs"], strict=True):
        assert a.shape == b.shape == (2, 16)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_losses_equal_tp1_over_three_adam_steps(results, layout):
    assert_losses_equal(results[layout]["loss"], results["tp1"]["loss"], STEPS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_lora_gradients_equal_tp1(results, layout):
    assert_gradients_equal(results[layout]["grads"], results["tp1"]["grads"], STEPS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_final_adapters_equal_tp1(results, layout):
    assert_adapters_equal(results[layout]["final"], results["tp1"]["final"])
