"""Export: chunk groups, PEFT names and §4.4 shapes, fresh BF16 copies, completeness; applying chunks on the
engine side; PEFT adapter files (checked with the ``peft`` library when it is installed)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from k3.config import variant
from k3.lora import LoRAConfig, LoRAConfigError, apply_lora
from k3.lora.export import (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, ExportError, adapter_nbytes, chunk_layout,
                            export_chunks, load_chunk, load_adapter_tensors, load_peft_adapter, save_peft_adapter)
from k3.model import KimiK3ForCausalLM

TINY = variant("tiny")
R = 4


def _model(seed=0, rank=R, targets=None, randomize_B=True):
    torch.manual_seed(seed)
    cfg = LoRAConfig(rank=rank, alpha=2 * rank, **({"target_modules": targets} if targets else {}))
    m = apply_lora(KimiK3ForCausalLM(TINY), cfg)
    if randomize_B:
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_()
    return m


def _expected_tiny_names_and_shapes(r=R):
    """§4.4 written out for the tiny config, independently of chunk_layout."""
    H, I, E, F, Lt, S = 64, 128, 8, 32, 32, 32  # S: one shared expert of width 32
    chunks = []
    for i in range(9):
        p = f"language_model.model.layers.{i}."
        attn = [(p + "self_attn.o_proj.lora_A.weight", (r, 64)), (p + "self_attn.o_proj.lora_B.weight", (H, r))]
        if i in (3, 7, 8):
            attn += [(p + "self_attn.q_a_proj.lora_A.weight", (r, H)), (p + "self_attn.q_a_proj.lora_B.weight", (32, r)),
                     (p + "self_attn.kv_a_proj_with_mqa.lora_A.weight", (r, H)),
                     (p + "self_attn.kv_a_proj_with_mqa.lora_B.weight", (16 + 8, r))]
        chunks.append(("attention", i, attn))

        def mlp(q, w):
            return [(q + "gate_proj.lora_A.weight", (r, H)), (q + "gate_proj.lora_B.weight", (w, r)),
                    (q + "up_proj.lora_A.weight", (r, H)), (q + "up_proj.lora_B.weight", (w, r)),
                    (q + "down_proj.lora_A.weight", (r, w)), (q + "down_proj.lora_B.weight", (H, r))]
        if i == 0:
            chunks.append(("dense_mlp", 0, mlp(p + "mlp.", I)))
            continue
        e = p + "block_sparse_moe.experts."
        chunks.append(("routed_experts", i, [
            (e + "w1.lora_A.weight", (1, r, Lt)), (e + "w1.lora_B.weight", (E, F, r)),
            (e + "w3.lora_A.weight", (1, r, Lt)), (e + "w3.lora_B.weight", (E, F, r)),
            (e + "w2.lora_A.weight", (E, r, F)), (e + "w2.lora_B.weight", (1, Lt, r))]))
        chunks.append(("shared_experts", i, mlp(p + "block_sparse_moe.shared_experts.", S)))
    return chunks


def test_chunks_names_shapes_and_flags_are_the_recipes():
    m = _model()
    chunks = list(export_chunks(m, version=3))
    got = [(c.group, c.layer, [(n, tuple(t.shape)) for n, t in c.tensors]) for c in chunks]
    assert got == _expected_tiny_names_and_shapes()
    assert [c.is_first for c in chunks] == [True] + [False] * (len(chunks) - 1)
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {c.version for c in chunks} == {3}
    assert all(c.config == m.lora_config.peft_config() for c in chunks)
    for c in chunks:
        for n, t in c.tensors:
            assert t.dtype == torch.bfloat16 and t.is_contiguous(), n


def test_values_are_fresh_copies_of_the_parameters():
    m = _model()
    chunk = next(c for c in export_chunks(m, 1) if c.group == "routed_experts")
    experts = m.model.layers[1].block_sparse_moe.experts
    named = dict(chunk.tensors)
    p = "language_model.model.layers.1.block_sparse_moe.experts."
    assert torch.equal(named[p + "w1.lora_A.weight"][0], experts.w1_lora_A.detach().bfloat16())
    assert torch.equal(named[p + "w2.lora_B.weight"][0], experts.w2_lora_B.detach().bfloat16())
    assert torch.equal(named[p + "w2.lora_A.weight"], experts.w2_lora_A.detach().bfloat16())
    m_bf16 = _model().to(torch.bfloat16)  # same dtype: the export must still copy, never alias
    for c in export_chunks(m_bf16, 1):
        params = {p.untyped_storage().data_ptr() for p in m_bf16.parameters()}
        assert all(t.untyped_storage().data_ptr() not in params for _, t in c.tensors)
    dense = next(c for c in export_chunks(m, 1) if c.group == "dense_mlp")
    d = dict(dense.tensors)
    q = "language_model.model.layers.0.mlp."
    assert torch.equal(d[q + "gate_proj.lora_A.weight"], d[q + "up_proj.lora_A.weight"])  # the shared fc1 A
    assert d[q + "gate_proj.lora_A.weight"].data_ptr() != d[q + "up_proj.lora_A.weight"].data_ptr()


def test_full_model_stream_is_278_chunks_of_1392_tensors():
    """The AG debug log's count for the full adapter: 93 attention + 1 dense + 92 routed + 92 shared chunks."""
    with torch.device("meta"):
        m = apply_lora(KimiK3ForCausalLM(variant("full")), LoRAConfig(rank=32, alpha=64))
    chunks = list(export_chunks(m, 1))
    assert len(chunks) == 278 and sum(len(c.tensors) for c in chunks) == 1392
    groups = [c.group for c in chunks]
    assert (groups.count("attention"), groups.count("dense_mlp"), groups.count("routed_experts"),
            groups.count("shared_experts")) == (93, 1, 92, 92)
    routed = next(c for c in chunks if c.group == "routed_experts")
    assert sum(t.numel() for _, t in routed.tensors) == 32 * 8_268_288  # ≈ 504.6 MiB in BF16
    shapes = dict((n.split("experts.")[1], tuple(t.shape)) for n, t in routed.tensors)
    assert shapes == {"w1.lora_A.weight": (1, 32, 3584), "w1.lora_B.weight": (896, 3072, 32),
                      "w3.lora_A.weight": (1, 32, 3584), "w3.lora_B.weight": (896, 3072, 32),
                      "w2.lora_A.weight": (896, 32, 3072), "w2.lora_B.weight": (1, 3584, 32)}
    o = dict(chunks[0].tensors)["language_model.model.layers.0.self_attn.o_proj.lora_A.weight"]
    assert tuple(o.shape) == (32, 12288)
    # the parameters once, plus the tied fc1 A sent twice (as gate A and up A) on the 93 dense/shared MLPs
    assert adapter_nbytes(chunk_layout(variant("full"), m.lora_config)) == (766_017_024 + 93 * 7168) * 32 * 2


def test_target_subset_exports_only_its_tensors():
    m = _model(targets=["self_attention.o_proj", "mlp.experts.linear_fc1"])
    chunks = list(export_chunks(m, 1))
    assert {c.group for c in chunks} == {"attention", "routed_experts"}
    assert all(len(c.tensors) == 2 for c in chunks if c.group == "attention")
    assert all(len(c.tensors) == 4 for c in chunks if c.group == "routed_experts")


def test_incomplete_adapters_raise_before_any_chunk():
    m = _model()
    attn = m.model.layers[3].self_attn
    plain = nn.Linear(attn.q_a_proj.in_features, attn.q_a_proj.out_features, bias=False)
    plain.weight = attn.q_a_proj.weight
    attn.q_a_proj = plain  # an adapter went missing
    with pytest.raises(ExportError, match=r"2 missing: \['language_model.model.layers.3.self_attn.q_a_proj"):
        export_chunks(m, 1)


def test_wrong_shapes_or_no_adapters_raise():
    m = _model()
    m.model.layers[2].self_attn.o_proj.lora_B = nn.Parameter(torch.zeros(64, R + 1))
    with pytest.raises(ExportError, match=r"wrong shape.*layers.2.self_attn.o_proj.lora_B.weight \(64, 5\)"):
        export_chunks(m, 1)
    with pytest.raises(ExportError, match="apply_lora first"):
        export_chunks(KimiK3ForCausalLM(TINY), 1)
    with pytest.raises(ValueError, match="version"):
        export_chunks(_model(), -1)


def test_load_chunk_reproduces_the_adapter_on_an_engine_model():
    src, dst = _model(seed=0), _model(seed=1, randomize_B=False)
    ids = torch.randint(0, TINY.vocab_size, (2, 5))
    src_bf16 = _model(seed=0)  # the values the engine can receive: adapters rounded to BF16
    with torch.no_grad():
        for n, p in src_bf16.named_parameters():
            if "lora_" in n:
                p.copy_(p.bfloat16().float())
    for chunk in export_chunks(src, 7):
        assert load_chunk(dst, chunk) == chunk.names
    dst.load_state_dict({k: v for k, v in src.state_dict().items() if "lora_" not in k}, strict=False)
    with torch.no_grad():
        for (n, p), (_, q) in zip(dst.named_parameters(), src_bf16.named_parameters()):
            if "lora_" in n:
                assert torch.equal(p, q), n
        torch.testing.assert_close(dst(ids), src_bf16(ids))


def test_load_errors_name_the_tensor():
    m = _model()
    chunk = next(iter(export_chunks(m, 1)))
    name, t = chunk.tensors[0]
    with pytest.raises(ExportError, match="matches no adapter"):
        load_adapter_tensors(m, [("language_model.model.layers.0.self_attn.q_proj.lora_A.weight", t)])
    with pytest.raises(ExportError, match=r"shape \(4, 65\), expected \(4, 64\)"):
        load_adapter_tensors(m, [(name, torch.zeros(4, 65))])
    with pytest.raises(ExportError, match="given twice"):
        load_adapter_tensors(m, [(name, t), (name, t)])
    q = "language_model.model.layers.0.mlp."
    with pytest.raises(ExportError, match="share"):
        load_adapter_tensors(m, [(q + "gate_proj.lora_A.weight", torch.zeros(4, 64)),
                                 (q + "up_proj.lora_A.weight", torch.ones(4, 64))])
    with pytest.raises(ExportError, match="missing"):
        load_adapter_tensors(m, [(name, t)], strict=True)


def test_peft_files_round_trip(tmp_path):
    src = _model()
    save_peft_adapter(src, tmp_path, base_model_name_or_path="tiny")
    cfg = json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == R and cfg["base_model_name_or_path"] == "tiny"
    from safetensors import safe_open
    with safe_open(str(tmp_path / ADAPTER_WEIGHTS_NAME), framework="pt") as f:
        keys = set(f.keys())
    assert len(keys) == sum(len(c.tensors) for c in export_chunks(src, 0))
    assert all(k.startswith("base_model.model.language_model.model.layers.") for k in keys)
    fresh = KimiK3ForCausalLM(TINY)
    load_peft_adapter(fresh, tmp_path)  # attaches the adapters from adapter_config.json, then loads them
    assert fresh.lora_config == src.lora_config
    want = {n: p.detach().bfloat16().float() for n, p in src.named_parameters() if "lora_" in n}
    got = {n: p.detach() for n, p in fresh.named_parameters() if "lora_" in n}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    with pytest.raises(LoRAConfigError, match="do not match"):
        load_peft_adapter(_model(rank=8), tmp_path)
    with pytest.raises(FileNotFoundError, match=ADAPTER_WEIGHTS_NAME):
        load_peft_adapter(_model(), tmp_path / "nowhere")


@pytest.mark.filterwarnings("ignore:Unexpected keyword arguments")  # our two extra keys; PEFT ignores them
def test_peft_library_reads_our_files_and_computes_the_same_dense_delta(tmp_path):
    """PEFT itself parses adapter_config.json, loads adapter_model.safetensors and, on a module tree with our
    names, reproduces LoRALinear's output for a dense target (the routed-expert tensors follow SGLang's
    shared-outer contract, which PEFT has no layer for)."""
    peft = pytest.importorskip("peft")
    src = _model()
    save_peft_adapter(src, tmp_path)
    config = peft.LoraConfig.from_pretrained(str(tmp_path))
    assert (config.r, config.lora_alpha, config.peft_type) == (R, 2 * R, peft.PeftType.LORA)
    weights = peft.utils.load_peft_weights(str(tmp_path), device="cpu")
    key = "base_model.model.language_model.model.layers.3.self_attn.o_proj.lora_B.weight"
    assert key in weights

    o_proj = src.model.layers[3].self_attn.o_proj

    class Toy(nn.Module):  # language_model.model.layers.3.self_attn.o_proj, the HF module path
        def __init__(self):
            super().__init__()
            self.language_model = nn.Module()
            self.language_model.model = nn.Module()
            self.language_model.model.layers = nn.ModuleList(nn.Module() for _ in range(4))
            self.language_model.model.layers[3].self_attn = nn.Module()
            lin = nn.Linear(o_proj.in_features, o_proj.out_features, bias=False)
            lin.weight.data.copy_(o_proj.weight.detach())
            self.language_model.model.layers[3].self_attn.o_proj = lin

        def forward(self, x):
            return self.language_model.model.layers[3].self_attn.o_proj(x)

    toy = peft.get_peft_model(Toy(), peft.LoraConfig(r=R, lora_alpha=2 * R, target_modules=["o_proj"]))
    prefix = "base_model.model.language_model.model.layers.3.self_attn.o_proj."
    mine = {k: v.float() for k, v in weights.items() if k.startswith(prefix)}
    result = peft.set_peft_model_state_dict(toy, mine)
    assert not [k for k in result.unexpected_keys if k.startswith(prefix)]
    x = torch.randn(3, o_proj.in_features)
    with torch.no_grad():
        want = nn.functional.linear(x, o_proj.weight) + o_proj.scale * (
            x @ o_proj.lora_A.bfloat16().float().T) @ o_proj.lora_B.bfloat16().float().T
        torch.testing.assert_close(toy.eval()(x), want, rtol=1e-5, atol=1e-5)
