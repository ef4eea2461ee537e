"""Megatron <-> HF names and layouts of every K3 parameter (recipe §3.1-3.2), as pure functions on state dicts.

Megatron names are the *global* keys of ``k3.megatron``'s model (and of its torch_dist checkpoints): layer
numbers are 0-based global indices, tensors are whole (no TP/EP split). HF names are the checkpoint's after
the ``language_model.`` prefix, i.e. the reference model's ``state_dict()`` names.

| Megatron (``decoder.layers.{i}.`` unless top level) | HF (``model.layers.{i}.`` unless top level) | layout |
|---|---|---|
| ``embedding.word_embeddings.weight`` | ``model.embed_tokens.weight`` | same |
| ``decoder.final_layernorm.weight`` | ``model.norm.weight`` | same |
| ``output_layer.weight`` | ``lm_head.weight`` | same |
| ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` | ``input_layernorm`` / ``post_attention_layernorm`` | same |
| ``{self_attention,mlp}_res_{norm,proj}.weight`` | same names | same |
| ``output_attn_res_{norm,proj}.weight`` (last layer) | ``model.output_attn_res_{norm,proj}.weight`` | same |
| ``self_attention.<p>`` (every KDA / MLA tensor) | ``self_attn.<p>`` | same, but ``A_log``: HF stores |
| | | ``a_log_stored_len`` entries (heads + zero padding), Megatron ``[heads]`` |
| ``mlp.linear_fc1.weight`` (dense) | ``mlp.gate_proj`` ; ``mlp.up_proj`` | ``[gate; up]`` on dim 0 |
| ``mlp.linear_fc2.weight`` | ``mlp.down_proj.weight`` | same |
| ``mlp.router.weight`` / ``mlp.router.expert_bias`` | ``block_sparse_moe.gate.weight`` / ``….e_score_correction_bias`` | same |
| ``mlp.fc1_latent_proj`` / ``mlp.fc2_latent_proj`` | ``….routed_expert_down_proj`` / ``….routed_expert_up_proj`` | same |
| ``mlp.routed_expert_norm.weight`` | ``block_sparse_moe.routed_expert_norm.weight`` | same |
| ``mlp.shared_experts.linear_fc1.weight`` | ``….shared_experts.gate_proj`` ; ``….up_proj`` | ``[gate; up]`` |
| ``mlp.shared_experts.linear_fc2.weight`` | ``….shared_experts.down_proj.weight`` | same |
| ``mlp.experts.linear_fc1.weight`` ``[E, 2F, Lt]`` | ``….experts.{e}.w1`` ; ``….experts.{e}.w3`` | stacked over e, ``[w1; w3]`` |
| ``mlp.experts.linear_fc2.weight`` ``[E, Lt, F]`` | ``….experts.{e}.w2.weight`` | stacked over e |

The routed experts are stored stacked (one ``[E, …]`` tensor per layer, expert-parallel on dim 0) rather than
TE's per-expert ``weight{e}``; the map is otherwise the recipe's. Unknown, missing or duplicated names raise
``NameMapError`` naming the tensor. Dtypes pass through unchanged (the F32 tensors stay F32).

LoRA adapters (``megatron_lora_to_hf`` / ``hf_lora_to_megatron``): Megatron factors
``decoder.layers.{i}.<linear>.lora.<factor>`` (global tensors) <-> the PEFT names of the adapter chunks,
``language_model.model.layers.{i}.<hf module>.lora_{A,B}.weight``, for every target of the table in
``k3/settings/lora.py`` (its Megatron module, factors and PEFT modules per block). A fused target's single A
(fc1's ``fc1_lora_A``) is each of its modules' ``lora_A`` (the gate's and the up's), its B is their B's stacked
on dim 0 (``[gate B; up B]``); the routed experts' shared factors carry a leading expert dim of 1 on the HF side.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from k3.config import K3Config
from k3.settings.lora import Block, LoRATarget, lora_targets

__all__ = [
    "NameMapError",
    "HFPart",
    "megatron_names",
    "hf_names",
    "hf_parts",
    "megatron_tensor",
    "hf_tensors",
    "hf_to_megatron",
    "megatron_to_hf",
    "EXPERT_FC1",
    "EXPERT_FC2",
    "megatron_lora_to_hf",
    "hf_lora_to_megatron",
]

EXPERT_FC1 = "mlp.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.linear_fc2.weight"


class NameMapError(ValueError):
    """A tensor name has no counterpart, a part is missing or duplicated, or a tensor has the wrong shape."""


# Parameters of each attention kind, identical names on both sides (under self_attention. / self_attn.).
KDA_PARAMS = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight",
    "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_proj.weight",
    "A_log", "dt_bias", "o_norm.weight", "o_proj.weight",
)
MLA_PARAMS = (
    "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
    "g_proj.weight", "o_proj.weight",
)
LAYER_COMMON = (  # (megatron suffix, hf suffix), both under the layer prefix
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attention_res_norm.weight", "self_attention_res_norm.weight"),
    ("self_attention_res_proj.weight", "self_attention_res_proj.weight"),
    ("mlp_res_norm.weight", "mlp_res_norm.weight"),
    ("mlp_res_proj.weight", "mlp_res_proj.weight"),
)
MOE_ONE_TO_ONE = (
    ("mlp.router.weight", "block_sparse_moe.gate.weight"),
    ("mlp.router.expert_bias", "block_sparse_moe.gate.e_score_correction_bias"),
    ("mlp.fc1_latent_proj.weight", "block_sparse_moe.routed_expert_down_proj.weight"),
    ("mlp.fc2_latent_proj.weight", "block_sparse_moe.routed_expert_up_proj.weight"),
)
TOP_LEVEL = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight"),
)
OUTPUT_ATTN_RES = (
    ("output_attn_res_norm.weight", "model.output_attn_res_norm.weight"),
    ("output_attn_res_proj.weight", "model.output_attn_res_proj.weight"),
)


@dataclass(frozen=True)
class HFPart:
    """How one Megatron tensor is built from HF tensors.

    ``kind``: ``same`` (one tensor as is), ``a_log`` (one tensor, padded on the HF side), ``cat`` (the HF
    tensors concatenated on dim 0: fc1 = [gate; up]), ``experts`` (per expert, ``hf_names[e]`` is the tuple of
    names concatenated into expert e's slice; the slices are stacked on a new dim 0).
    """

    kind: str
    hf_names: tuple  # tuple[str, ...] for same/a_log/cat; tuple[tuple[str, ...], ...] (one per expert) for experts


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_parts(cfg: K3Config, i: int) -> dict[str, HFPart]:
    """Megatron suffix (after ``decoder.layers.{i}.``) -> HF parts, for layer ``i``."""
    hf = f"model.layers.{i}."
    parts: dict[str, HFPart] = {m: HFPart("same", (hf + h,)) for m, h in LAYER_COMMON}
    for p in KDA_PARAMS if cfg.is_kda_layer(i) else MLA_PARAMS:
        parts[f"self_attention.{p}"] = HFPart("a_log" if p == "A_log" else "same", (f"{hf}self_attn.{p}",))
    if cfg.is_moe_layer(i):
        moe = hf + "block_sparse_moe."
        for m, h in MOE_ONE_TO_ONE:
            parts[m] = HFPart("same", (hf + h,))
        if cfg.latent_moe_use_norm:
            parts["mlp.routed_expert_norm.weight"] = HFPart("same", (moe + "routed_expert_norm.weight",))
        if cfg.num_shared_experts > 0:
            parts["mlp.shared_experts.linear_fc1.weight"] = HFPart(
                "cat", (moe + "shared_experts.gate_proj.weight", moe + "shared_experts.up_proj.weight"))
            parts["mlp.shared_experts.linear_fc2.weight"] = HFPart("same", (moe + "shared_experts.down_proj.weight",))
        E = cfg.num_experts
        parts[EXPERT_FC1] = HFPart("experts", tuple(
            (f"{moe}experts.{e}.w1.weight", f"{moe}experts.{e}.w3.weight") for e in range(E)))
        parts[EXPERT_FC2] = HFPart("experts", tuple((f"{moe}experts.{e}.w2.weight",) for e in range(E)))
    else:
        parts["mlp.linear_fc1.weight"] = HFPart("cat", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"))
        parts["mlp.linear_fc2.weight"] = HFPart("same", (hf + "mlp.down_proj.weight",))
    if i == cfg.num_hidden_layers - 1:
        for m, h in OUTPUT_ATTN_RES:
            parts[m] = HFPart("same", (h,))
    return parts


def _all_parts(cfg: K3Config) -> dict[str, HFPart]:
    parts = {m: HFPart("same", (h,)) for m, h in TOP_LEVEL}
    for i in range(cfg.num_hidden_layers):
        parts.update({f"decoder.layers.{i}.{m}": p for m, p in _layer_parts(cfg, i).items()})
    return parts


def megatron_names(cfg: K3Config, layers: Iterable[int] | None = None, top_level: bool = True) -> list[str]:
    """Every Megatron tensor name of the model (or of ``layers`` only, plus the top-level tensors when
    ``top_level``), in model order."""
    out = [m for m, _ in TOP_LEVEL] if top_level else []
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        out += [f"decoder.layers.{i}.{m}" for m in _layer_parts(cfg, i)]
    return out


def hf_parts(name: str, cfg: K3Config) -> HFPart:
    """The HF tensors Megatron tensor ``name`` is made of."""
    m = _LAYER.match(name)
    if m is None:
        top = dict(TOP_LEVEL)
        if name in top:
            return HFPart("same", (top[name],))
        raise NameMapError(f"Megatron tensor {name!r}: not a K3 parameter name")
    i, suffix = int(m.group(1)), m.group(2)
    if i >= cfg.num_hidden_layers:
        raise NameMapError(f"Megatron tensor {name!r}: layer {i} is past num_hidden_layers "
                           f"({cfg.num_hidden_layers})")
    part = _layer_parts(cfg, i).get(suffix)
    if part is None:
        kind = ("KDA" if cfg.is_kda_layer(i) else "MLA") + "+" + ("MoE" if cfg.is_moe_layer(i) else "dense")
        raise NameMapError(f"Megatron tensor {name!r}: layer {i} ({kind}) has no parameter {suffix!r}")
    return part


def hf_names(cfg: K3Config) -> list[str]:
    """Every HF tensor name of the model (after ``language_model.``)."""
    out: list[str] = []
    for part in _all_parts(cfg).values():
        out += [n for group in part.hf_names for n in group] if part.kind == "experts" else list(part.hf_names)
    return out


def megatron_tensor(name: str, read_hf: Callable[[str], torch.Tensor], cfg: K3Config,
                    experts: range | None = None) -> torch.Tensor:
    """Build Megatron tensor ``name`` (global, unsharded) from HF tensors fetched with ``read_hf(hf_name)``.

    ``experts`` limits a stacked expert tensor to those experts (``[len(experts), …]``), so an EP rank reads only
    its own; it is ignored for every other tensor.
    """
    part = hf_parts(name, cfg)
    if part.kind == "same":
        return read_hf(part.hf_names[0])
    if part.kind == "a_log":
        return _unpad_a_log(part.hf_names[0], read_hf(part.hf_names[0]), cfg)
    if part.kind == "cat":
        return _cat(part.hf_names, [read_hf(n) for n in part.hf_names])
    chosen = range(len(part.hf_names)) if experts is None else experts
    if len(chosen) == 0 or chosen.start < 0 or chosen.stop > len(part.hf_names):
        raise NameMapError(f"{name}: experts {chosen} outside 0..{len(part.hf_names) - 1}")
    slices = [_cat(part.hf_names[e], [read_hf(n) for n in part.hf_names[e]]) for e in chosen]
    shapes = {tuple(s.shape) for s in slices}
    if len(shapes) != 1:
        raise NameMapError(f"{name}: experts have different shapes {sorted(shapes)}")
    return torch.stack(slices)


def hf_tensors(name: str, tensor: torch.Tensor, cfg: K3Config) -> list[tuple[str, torch.Tensor]]:
    """Split Megatron tensor ``name`` (global) into its HF tensors, as ``(hf_name, tensor)`` pairs (views where
    the layout allows)."""
    part = hf_parts(name, cfg)
    if part.kind == "same":
        return [(part.hf_names[0], tensor)]
    if part.kind == "a_log":
        heads = cfg.linear_attn_config.num_heads
        if tuple(tensor.shape) != (heads,):
            raise NameMapError(f"{name}: shape {tuple(tensor.shape)}, expected ({heads},)")
        pad = cfg.a_log_stored_len - heads
        return [(part.hf_names[0], torch.cat([tensor, tensor.new_zeros(pad)]) if pad else tensor)]
    if part.kind == "cat":
        return list(zip(part.hf_names, _split_halves(name, tensor, len(part.hf_names))))
    E = len(part.hf_names)
    if tensor.dim() < 1 or tensor.shape[0] != E:
        raise NameMapError(f"{name}: shape {tuple(tensor.shape)}, expected a leading expert dim of {E}")
    out = []
    for e in range(E):
        names = part.hf_names[e]
        out += list(zip(names, _split_halves(name, tensor[e], len(names)) if len(names) > 1 else [tensor[e]]))
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], cfg: K3Config,
                   layers: Iterable[int] | None = None, top_level: bool = True) -> dict[str, torch.Tensor]:
    """HF state dict (names after ``language_model.``) -> Megatron state dict (global tensors).

    With ``layers``/``top_level`` only that part of the model is converted and ``hf`` may hold just its tensors.
    Every tensor in ``hf`` must be used exactly once: unknown names raise, and so do missing ones.
    """
    wanted = megatron_names(cfg, layers, top_level)
    used: set[str] = set()

    def read(n: str) -> torch.Tensor:
        if n not in hf:
            raise NameMapError(f"HF tensor {n!r} is missing (needed for the Megatron model)")
        used.add(n)
        return hf[n]

    out = {name: megatron_tensor(name, read, cfg) for name in wanted}
    unused = sorted(set(hf) - used)
    if unused:
        more = f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""
        raise NameMapError(f"HF tensors with no Megatron counterpart: {unused[:5]}{more}")
    return out


def megatron_to_hf(mg: Mapping[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """Megatron state dict (global tensors; any subset of the model) -> HF state dict. Unknown names raise."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mg.items():
        for hf_name, t in hf_tensors(name, tensor, cfg):
            if hf_name in out:
                raise NameMapError(f"HF tensor {hf_name!r} produced twice (last from {name!r})")
            out[hf_name] = t
    return out


# ---------------------------------------------------------------------------------------------- layout helpers
def _unpad_a_log(hf_name: str, t: torch.Tensor, cfg: K3Config) -> torch.Tensor:
    heads = cfg.linear_attn_config.num_heads
    if t.dim() != 1 or t.shape[0] < heads:
        raise NameMapError(f"{hf_name}: shape {tuple(t.shape)}, expected [{cfg.a_log_stored_len}] "
                           f"({heads} heads + zero padding) or [{heads}]")
    tail = t[heads:]
    if tail.numel() and not tail.is_meta and bool(tail.ne(0).any()):
        raise NameMapError(f"{hf_name}: entries past the {heads} heads are not zero; dropping them would lose "
                           "data (expected zero padding)")
    return t[:heads]


def _cat(names: Sequence[str], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise NameMapError(f"{', '.join(names)}: shapes {[tuple(p.shape) for p in parts]} differ; expected equal "
                           "halves to fuse")
    return torch.cat(list(parts), dim=0)


def _split_halves(name: str, t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    if t.shape[0] % n:
        raise NameMapError(f"{name}: dim 0 ({t.shape[0]}) is not divisible into {n} fused parts")
    return t.chunk(n, dim=0)


# ---------------------------------------------------------------------------------------------- LoRA adapters
_LORA = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora\.(\w+_lora_[AB])$")


def _lora_sites() -> tuple[dict[str, tuple[LoRATarget, Block]], dict[str, tuple[LoRATarget, Block, int]]]:
    """Every block a target may sit in, by its Megatron module (``mlp.shared_experts.linear_fc1``), and by its
    PEFT module (``block_sparse_moe.shared_experts.up_proj``, with the module's index in ``target.modules``)."""
    return _lora_sites_of(lora_targets())


@functools.lru_cache(maxsize=4)  # the export maps one factor at a time
def _lora_sites_of(table: tuple[LoRATarget, ...]) -> tuple[dict[str, tuple[LoRATarget, Block]],
                                                            dict[str, tuple[LoRATarget, Block, int]]]:
    by_megatron: dict[str, tuple[LoRATarget, Block]] = {}
    by_peft: dict[str, tuple[LoRATarget, Block, int]] = {}
    for target in table:
        for block in target.placement.blocks:
            by_megatron[target.megatron_module(block)] = (target, block)
            for k, module in enumerate(target.peft_modules(block)):
                by_peft[module] = (target, block, k)
    return by_megatron, by_peft


def _fused_names(target: LoRATarget) -> str:
    """``gate and up``: the parts of a fused target, for messages."""
    return " and ".join(m.removesuffix("_proj") for m in target.modules)


def megatron_lora_to_hf(lora: Mapping[str, torch.Tensor], cfg: K3Config,
                        prefix: str = "language_model.") -> dict[str, torch.Tensor]:
    """Global Megatron adapter factors -> PEFT-named adapter tensors (``prefix`` + ``model.layers.…``)."""
    by_megatron, _ = _lora_sites()
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor, source: str) -> None:
        if name in out:
            raise NameMapError(f"adapter tensor {name!r} produced twice (last from {source!r})")
        out[name] = t

    for name, t in lora.items():
        m = _LORA.match(name)
        if m is None:
            raise NameMapError(f"Megatron adapter {name!r}: expected decoder.layers.{{i}}.<linear>.lora.<factor>")
        i, site, factor = int(m.group(1)), m.group(2), m.group(3)
        if i >= cfg.num_hidden_layers:
            raise NameMapError(f"Megatron adapter {name!r}: layer {i} is past num_hidden_layers")
        prefix_of_factor, _, ab = factor.rpartition("_lora_")
        target, block = by_megatron.get(site, (None, None))
        if target is None or prefix_of_factor not in target.factors:
            raise NameMapError(f"Megatron adapter {name!r}: factor {factor!r} does not belong to {site!r}")
        hf = [f"{prefix}model.layers.{i}.{module}" for module in target.peft_modules(block)]
        if not target.fused:
            shared = ab == target.shared_expert_factor  # a routed-expert factor shared by all experts
            put(f"{hf[target.factors.index(prefix_of_factor)]}.lora_{ab}.weight", t.unsqueeze(0) if shared else t,
                name)
        elif ab == "A":  # one A for the fused modules
            for module in hf:
                put(f"{module}.lora_A.weight", t, name)
        else:
            for module, part in zip(hf, _split_halves(name, t, len(hf))):
                put(f"{module}.lora_B.weight", part, name)
    return out


_HF_LORA = re.compile(r"^model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def hf_lora_to_megatron(hf: Mapping[str, torch.Tensor], cfg: K3Config,
                        prefix: str = "language_model.") -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors -> global Megatron adapter factors (inverse of ``megatron_lora_to_hf``).

    The ``lora_A`` of a fused target's modules (the gate's and the up's of one MLP) must be equal: they are
    Megatron's single A of the fused linear.
    """
    _, by_peft = _lora_sites()
    parts: dict[str, tuple[LoRATarget, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for raw, t in hf.items():
        name = raw[len(prefix):] if prefix and raw.startswith(prefix) else raw
        m = _HF_LORA.match(name)
        if m is None:
            raise NameMapError(f"adapter tensor {raw!r}: expected "
                               f"{prefix}model.layers.{{i}}.<module>.lora_{{A,B}}.weight")
        i, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in by_peft:
            raise NameMapError(f"adapter tensor {raw!r}: {module!r} is not a K3 LoRA target")
        target, block, k = by_peft[module]
        linear = f"decoder.layers.{i}.{target.megatron_module(block)}.lora"
        if target.fused:
            parts.setdefault(f"{linear}.{target.factors[0]}_lora_{ab}", (target, {}))[1][k] = t
            continue
        if ab == target.shared_expert_factor:
            if t.dim() == 0 or t.shape[0] != 1:
                raise NameMapError(f"adapter tensor {raw!r}: shape {tuple(t.shape)}, expected a leading "
                                   "expert dim of 1 (a shared factor)")
            t = t[0]
        out[f"{linear}.{target.factors[k]}_lora_{ab}"] = t
    for name, (target, by_index) in parts.items():
        if len(by_index) != len(target.modules):
            raise NameMapError(f"{name}: needs both the {' and '.join(target.modules)} adapter tensors, got "
                               f"{sorted(target.modules[k] for k in by_index)}")
        tensors = [by_index[k] for k in range(len(target.modules))]
        if name.endswith("_lora_A"):
            if not all(torch.equal(tensors[0], t) for t in tensors[1:]):
                raise NameMapError(f"{name}: the {_fused_names(target)} lora_A differ; Megatron's fused "
                                   f"{target.factors[0]} has one A")
            out[name] = tensors[0]
        else:
            out[name] = _cat(tuple(f"{name} ({m.removesuffix('_proj')})" for m in target.modules), tensors)
    return out
