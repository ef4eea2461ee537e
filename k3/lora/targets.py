"""The recipe's seven Megatron LoRA targets, mapped onto our HF-named modules.

The recipe names targets by Megatron module (``decoder.layers.*.<target>``); our model uses the HF
checkpoint's module names. The mapping, and the coverage the recipe's wrapper gives each target (§4.1):

| recipe target | our modules | layers | export group |
|---|---|---|---|
| ``self_attention.o_proj`` | ``model.layers.{i}.self_attn.o_proj`` | every layer (KDA and MLA) | attention of layer i |
| ``self_attention.q_a_proj`` | ``model.layers.{i}.self_attn.q_a_proj`` | MLA layers | attention of layer i |
| ``self_attention.kv_a_proj_with_mqa`` | ``model.layers.{i}.self_attn.kv_a_proj_with_mqa`` | MLA layers | attention of layer i |
| ``mlp.linear_fc1`` (Megatron's fused [gate; up]) | ``model.layers.{i}.mlp.{gate_proj,up_proj}`` and ``model.layers.{i}.block_sparse_moe.shared_experts.{gate_proj,up_proj}`` | dense layers (0) and every MoE layer's shared experts | dense MLP / shared experts of layer i |
| ``mlp.linear_fc2`` | ``….mlp.down_proj`` and ``….shared_experts.down_proj`` | same | same |
| ``mlp.experts.linear_fc1`` | ``model.layers.{i}.block_sparse_moe.experts`` (``w1`` gate, ``w3`` up) | MoE layers | routed experts of layer i |
| ``mlp.experts.linear_fc2`` | ``model.layers.{i}.block_sparse_moe.experts`` (``w2`` down) | MoE layers | routed experts of layer i |

In Megatron the shared experts are the MoE layer's ``mlp.shared_experts.linear_fc1/fc2``, which the
recipe's ``mlp.linear_fc1/fc2`` patterns also match: shared experts are adapted whenever the dense MLP is,
and are not separately targetable. Because Megatron's fc1 is one fused linear with one ``fc1_lora_A``, our
gate and up projections of one MLP share a single ``lora_A`` Parameter (export: gate A = up A). KDA's
q/k/v/conv/f/b/g projections are deliberately not targets (SGLang fuses them in its K3 serving modules).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from k3.config import K3Config
from k3.lora.config import LoRAConfigError
from k3.model.moe import LatentExperts

__all__ = ["AdapterSite", "TARGET_PATTERNS", "GROUPS", "find_sites", "expected_sites"]

# Export groups, one chunk each per layer, in the order a layer's chunks are sent.
GROUPS = ("attention", "dense_mlp", "routed_experts", "shared_experts")

_L = r"model\.layers\.(\d+)\."

# target -> [(module-path regex, export group, module type)]
TARGET_PATTERNS: dict[str, list[tuple[re.Pattern[str], str, type]]] = {
    "self_attention.o_proj": [(re.compile(_L + r"self_attn\.o_proj"), "attention", nn.Linear)],
    "self_attention.q_a_proj": [(re.compile(_L + r"self_attn\.q_a_proj"), "attention", nn.Linear)],
    "self_attention.kv_a_proj_with_mqa": [
        (re.compile(_L + r"self_attn\.kv_a_proj_with_mqa"), "attention", nn.Linear)],
    "mlp.linear_fc1": [
        (re.compile(_L + r"mlp\.(?:gate_proj|up_proj)"), "dense_mlp", nn.Linear),
        (re.compile(_L + r"block_sparse_moe\.shared_experts\.(?:gate_proj|up_proj)"), "shared_experts", nn.Linear),
    ],
    "mlp.linear_fc2": [
        (re.compile(_L + r"mlp\.down_proj"), "dense_mlp", nn.Linear),
        (re.compile(_L + r"block_sparse_moe\.shared_experts\.down_proj"), "shared_experts", nn.Linear),
    ],
    "mlp.experts.linear_fc1": [(re.compile(_L + r"block_sparse_moe\.experts"), "routed_experts", LatentExperts)],
    "mlp.experts.linear_fc2": [(re.compile(_L + r"block_sparse_moe\.experts"), "routed_experts", LatentExperts)],
}


@dataclass(frozen=True)
class AdapterSite:
    """One module a target adapts: ``module`` is its path in the model (HF names without ``language_model.``)."""

    target: str
    group: str
    layer: int
    module: str


def find_sites(model: nn.Module, targets: Sequence[str]) -> list[AdapterSite]:
    """Every module of ``model`` the (normalized) ``targets`` select, in model order.

    Raises ``LoRAConfigError`` if a target matches no module, or matches a module of the wrong type.
    """
    modules = list(model.named_modules())
    sites: list[AdapterSite] = []
    for target in targets:
        if target not in TARGET_PATTERNS:
            raise LoRAConfigError(f"LoRA target {target!r} is unknown: expected one of {list(TARGET_PATTERNS)}")
        found = []
        for name, module in modules:
            for pattern, group, kind in TARGET_PATTERNS[target]:
                m = pattern.fullmatch(name)
                if m is None:
                    continue
                if not isinstance(module, kind):
                    raise LoRAConfigError(f"LoRA target {target!r} matches {name}, a {type(module).__name__}: "
                                          f"expected a {kind.__name__}")
                found.append(AdapterSite(target, group, int(m.group(1)), name))
        if not found:
            raise LoRAConfigError(f"LoRA target {target!r} matches no module of {type(model).__name__} "
                                  f"(looked for {[p.pattern for p, _, _ in TARGET_PATTERNS[target]]})")
        sites += found
    order = {name: i for i, (name, _) in enumerate(modules)}
    return sorted(sites, key=lambda s: (order[s.module], s.target))


def expected_sites(cfg: K3Config, targets: Sequence[str]) -> list[AdapterSite]:
    """The sites the recipe's coverage rules give a model of ``cfg`` (the schedule, not the module tree)."""
    sites: list[AdapterSite] = []
    t = set(targets)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if "self_attention.o_proj" in t:
            sites.append(AdapterSite("self_attention.o_proj", "attention", i, p + "self_attn.o_proj"))
        if not cfg.is_kda_layer(i):
            for name in ("q_a_proj", "kv_a_proj_with_mqa"):
                if f"self_attention.{name}" in t:
                    sites.append(AdapterSite(f"self_attention.{name}", "attention", i, p + f"self_attn.{name}"))
        if cfg.is_moe_layer(i):
            mlp, group = p + "block_sparse_moe.shared_experts.", "shared_experts"
            for target in ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2"):
                if target in t:
                    sites.append(AdapterSite(target, "routed_experts", i, p + "block_sparse_moe.experts"))
            if cfg.num_shared_experts == 0:
                continue
        else:
            mlp, group = p + "mlp.", "dense_mlp"
        if "mlp.linear_fc1" in t:
            sites += [AdapterSite("mlp.linear_fc1", group, i, mlp + n) for n in ("gate_proj", "up_proj")]
        if "mlp.linear_fc2" in t:
            sites.append(AdapterSite("mlp.linear_fc2", group, i, mlp + "down_proj"))
    return sites
