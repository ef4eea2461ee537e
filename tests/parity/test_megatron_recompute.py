"""Activation recompute on the megatron backend (megatron-core's own, ``k3.megatron.recompute``), CPU: the
activations held between forward and backward drop, the gradients stay the same.

Worker (this file as a script, one process, tests/megatron_compat.py): tiny K3 with LoRA (every B non-zero) under
each recompute setting; the forward of a training step runs under ``torch.autograd.graph.saved_tensors_hooks``,
which sees every tensor autograd keeps for the backward (megatron's checkpoints keep only their inputs). Held =
the distinct storages saved that are not parameters (a saved weight costs nothing extra). Then the backward's
LoRA gradients are compared with the no-recompute run's. A packed batch under full recompute checks the two
together. The configuration errors are checked in process.
"""

from __future__ import annotations

import sys

import pytest
import torch

SETTINGS = {  # name -> (granularity, method, num_layers, modules)
    "none": (None, None, None, None),
    "full_uniform_1": ("full", "uniform", 1, None),
    "full_uniform_3": ("full", "uniform", 3, None),
    "full_block_4": ("full", "block", 4, None),
    "selective_core_attn": ("selective", None, None, None),
    "selective_all": ("selective", None, None, ("core_attn", "layernorm", "mlp", "moe", "shared_experts")),
    "packed_none": (None, None, None, None),
    "packed_full_uniform_1": ("full", "uniform", 1, None),
}
GRAD_REL = 1e-5  # the same float32 math recomputed; only the order of gradient accumulation may differ


def _held_and_grads(name: str, cfg, ref) -> dict:
    from test_megatron_parallel import _with_random_B

    from megatron.core import tensor_parallel
    from torch.profiler import ProfilerActivity, profile

    from k3.lora import LoRAConfig
    from k3.megatron.checkpoint import load_hf_state_dict
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.lora import apply_megatron_lora, gather_lora, load_lora
    from k3.megatron.model import k3_model_provider
    from k3.megatron.packed import packed_seq_params
    from k3.megatron.recompute import Recompute

    granularity, method, layers, modules = SETTINGS[name]
    config = k3_transformer_config(cfg, perform_initialization=False,
                                   recompute=Recompute(granularity, method, layers, modules))
    model = k3_model_provider(config)
    load_hf_state_dict(model, ref.state_dict(), cfg)
    apply_megatron_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=0)
    load_lora(model, _with_random_B(gather_lora(model)))
    gen = torch.Generator().manual_seed(4)
    packed = name.startswith("packed")
    ids = torch.randint(0, cfg.vocab_size, (1, 48) if packed else (2, 32), generator=gen)
    params = packed_seq_params([0, 13, 30, 48], "cpu") if packed else None
    weight = torch.randn(*ids.shape, cfg.vocab_size, generator=gen)
    model.train()
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}
    count = [0]

    def pack(t: torch.Tensor):
        count[0] += 1
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    strided: dict[str, list] = {}  # megatron linear -> the (shape, strides) of its inputs that torch.matmul cannot fold

    def note_input(name):
        def hook(module, args):
            x = args[0]
            if x.stride() != torch.empty(x.shape).stride():
                strided.setdefault(name, []).append((tuple(x.shape), x.stride()))
        return hook

    hooks = [m.register_forward_pre_hook(note_input(n)) for n, m in model.named_modules()
             if isinstance(m, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear))]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids, None, None, packed_seq_params=params)
            loss = (logits.float() * weight).sum() / ids.numel()
        held_bytes, saved = sum(held.values()), count[0]
        loss.backward()
    for h in hooks:
        h.remove()
    # torch.matmul's fallback when it cannot fold [s, b, in]: a bmm over every token, in the forward or the backward
    tokens, b = ids.shape[1], ids.shape[0]
    per_token = sorted({str(e.input_shapes[0]) for e in prof.events() if e.name == "aten::bmm"
                        and e.input_shapes and e.input_shapes[0][:2] == [tokens, b]})
    return {"held_bytes": held_bytes, "saved": saved, "loss": loss.item(), "grads": gather_lora(model, grads=True),
            "linears": len(hooks), "strided_inputs": strided, "per_token_gemms": per_token}


def _worker(out_path: str) -> None:
    import megatron_compat

    megatron_compat.install()
    from test_megatron_parallel import _reference_and_data

    from k3.settings.parallel import ParallelLayout
    from k3.megatron.parallel import init_parallel

    init_parallel(ParallelLayout.model_parallel())
    cfg, ref, _ = _reference_and_data()
    torch.save({name: _held_and_grads(name, cfg, ref) for name in SETTINGS}, out_path)


if __name__ == "__main__":
    _worker(sys.argv[1])


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from megatron_compat import run_workers

    out = tmp_path_factory.mktemp("megatron_recompute") / "results.pt"
    run_workers([__file__, str(out)], nproc=1)
    return torch.load(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", [n for n in SETTINGS if n not in ("none", "packed_none")])
def test_recompute_keeps_the_loss_and_every_lora_gradient(results, name):
    base = results["packed_none" if name.startswith("packed") else "none"]
    got = results[name]
    assert got["loss"] == base["loss"]
    assert sorted(got["grads"]) == sorted(base["grads"]) and len(base["grads"]) > 10
    for k, g in base["grads"].items():
        assert g.norm() > 0, k  # every adapter gets a gradient: the checkpoints let it through
        assert _rel(got["grads"][k], g) < GRAD_REL, k


@pytest.mark.parametrize("name", ["none", "packed_none"])
def test_every_megatron_linear_gets_an_input_torch_matmul_folds_into_one_gemm(results, name):
    """Canonical strides on every input of megatron's column/row-parallel linears (k3/megatron/sequence_major.py):
    otherwise torch.matmul runs one GEMM per token, re-reading the weight; the packed batch (b = 1) is the case.
    The backward too: the LM head's output gradient comes back transposed."""
    assert results[name]["linears"] > 10
    assert results[name]["strided_inputs"] == {}
    # and no GEMM split per token anywhere in the step: the LM head's input gradient was (k3/megatron/sequence_major)
    assert results[name]["per_token_gemms"] == []


def test_full_recompute_holds_far_fewer_activations(results):
    none, full = results["none"]["held_bytes"], results["full_uniform_1"]["held_bytes"]
    assert full < 0.2 * none, (full, none)
    # chunks of 3 layers keep a third of the layer inputs of chunks of 1; block 4 keeps 5 of the 9 layers whole
    assert results["full_uniform_3"]["held_bytes"] < full
    assert full < results["full_block_4"]["held_bytes"] < none
    assert results["packed_full_uniform_1"]["held_bytes"] < 0.2 * results["packed_none"]["held_bytes"]


def test_selective_recompute_holds_less_the_more_modules_it_lists(results):
    none = results["none"]["held_bytes"]
    core = results["selective_core_attn"]["held_bytes"]
    every = results["selective_all"]["held_bytes"]
    assert every < core < none, (every, core, none)


# ---------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("kwargs, match", [
    ({"granularity": "some"}, "recompute_granularity='some'"),
    ({"granularity": "full"}, "needs recompute_method 'uniform' or 'block'"),
    ({"granularity": "full", "method": "uniform"}, "needs recompute_num_layers >= 1"),
    ({"granularity": "full", "method": "uniform", "num_layers": 0}, "needs recompute_num_layers >= 1"),
    ({"granularity": "selective", "method": "uniform", "num_layers": 1}, "to recompute_granularity 'full' only"),
    ({"method": "block"}, "to recompute_granularity 'full' only"),
    ({"granularity": "full", "method": "uniform", "num_layers": 1, "modules": ("mlp",)}, "only for recompute_granul"),
    ({"granularity": "selective", "modules": ("mla_up_proj",)}, r"recompute_modules \['mla_up_proj'\]"),
])
def test_recompute_settings_are_checked(kwargs, match):
    from k3.megatron.recompute import Recompute

    with pytest.raises(ValueError, match=match):
        Recompute(**kwargs)


def test_uniform_chunks_must_divide_every_pipeline_stage():
    from k3.config import variant
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout
    from k3.megatron.recompute import Recompute

    cfg = variant("tiny").replace(quantization_config=None)  # 9 layers
    with pytest.raises(ValueError, match=r"stages hold \[4, 5\] layers"):
        k3_transformer_config(cfg, ParallelLayout.model_parallel(pp=2, first_stage_layers=4),
                              recompute=Recompute("full", "uniform", 2))
    config = k3_transformer_config(cfg, ParallelLayout.model_parallel(pp=2, first_stage_layers=4),
                                   recompute=Recompute("full", "block", 2))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    selective = k3_transformer_config(cfg, recompute=Recompute("selective", modules=("moe", "layernorm")))
    assert selective.recompute_modules == ["moe", "layernorm"] and selective.recompute_method is None
    assert k3_transformer_config(cfg).recompute_granularity is None
