"""LoRA settings: ``LoRAConfig`` and the one table of LoRA targets that every part reads.

The recipe names its targets by Megatron module (``decoder.layers.*.<target>``); our reference model uses the HF
checkpoint's module names, the serving side (SGLang, PEFT) HF target names, and the Megatron backend shards each
factor by how its base linear is parallelized. One row (``LoRATarget``) per target holds all of that, so adding a
target is adding a row to ``LORA_TARGETS``:

| name | placement (layers, export group) | modules | serving names | factors | style | in -> out | optional |
|---|---|---|---|---|---|---|---|
| ``self_attention.o_proj`` | every layer's attention | ``o_proj`` | ``o_proj`` | ``o`` | row, all-reduce | KDA ``heads·head_dim``, MLA ``heads·v_head_dim`` -> hidden | |
| ``self_attention.q_a_proj`` | MLA layers' attention | ``q_a_proj`` | ``q_a_proj`` | ``q_a`` | duplicated | hidden -> ``q_lora_rank`` | |
| ``self_attention.kv_a_proj_with_mqa`` | MLA layers' attention | ``kv_a_proj_with_mqa`` | same | ``kv_a`` | duplicated | hidden -> ``kv_lora_rank + rope`` | |
| ``mlp.linear_fc1`` | dense layers' MLP and MoE layers' shared experts | ``gate_proj``, ``up_proj`` | ``gate_proj``, ``up_proj`` | ``fc1`` (fused) | column | hidden -> F | |
| ``mlp.linear_fc2`` | same | ``down_proj`` | ``down_proj`` | ``fc2`` | row, reduce-scatter | F -> hidden | |
| ``mlp.experts.linear_fc1`` | MoE layers' routed experts | ``w1``, ``w3`` | ``gate_proj``, ``up_proj`` | ``w1``, ``w3`` | expert fc1 | latent -> expert F | |
| ``mlp.experts.linear_fc2`` | MoE layers' routed experts | ``w2`` | ``down_proj`` | ``w2`` | expert fc2 | expert F -> latent | yes |

(F is ``intermediate_size`` in a dense layer, the shared experts' width in a MoE layer.) The blocks a placement
puts its modules in, with their module paths on each side and their export group (one adapter chunk per group
and layer, sent in this order):

| block | HF (under ``model.layers.{i}.``) | Megatron (under ``decoder.layers.{i}.``) | export group |
|---|---|---|---|
| attention | ``self_attn.`` | ``self_attention.`` | ``attention`` |
| dense MLP | ``mlp.`` | ``mlp.`` | ``dense_mlp`` |
| routed experts | ``block_sparse_moe.experts`` (``.w1`` … in PEFT names) | ``mlp.experts.`` | ``routed_experts`` |
| shared experts | ``block_sparse_moe.shared_experts.`` | ``mlp.shared_experts.`` | ``shared_experts`` |

In Megatron the shared experts are the MoE layer's ``mlp.shared_experts.linear_fc1/fc2``, which the recipe's
``mlp.linear_fc1/fc2`` patterns also match: shared experts are adapted whenever the dense MLP is, and are not
separately targetable. Megatron's fc1 is one fused linear with one ``fc1_lora_A``, so the gate and up projections
of one MLP share a single ``lora_A`` (export: gate A = up A). KDA's q/k/v/conv/f/b/g projections are
deliberately not targets (SGLang fuses them in its K3 serving modules).

This module is pure data: it imports only ``k3.config`` and the standard library. Module kinds and parallel styles
are enums; ``k3.lora`` and ``k3.megatron.lora`` map them to module classes. Every reader goes through
``lora_targets()`` (or the helpers built on it) at call time, never a copy taken at import.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3.config import K3Config

__all__ = [
    "Block",
    "ATTENTION",
    "DENSE_MLP",
    "ROUTED_EXPERTS",
    "SHARED_EXPERTS",
    "EXPORT_GROUPS",
    "Placement",
    "ParallelStyle",
    "ModuleKind",
    "LoRATarget",
    "LORA_TARGETS",
    "MEGATRON_PREFIX",
    "lora_targets",
    "lora_target",
    "target_names",
    "optional_target_names",
    "LoRAConfig",
    "LoRAConfigError",
]

MEGATRON_PREFIX = "decoder.layers.*."  # the recipe's target pattern prefix, optional in a config


class LoRAConfigError(ValueError):
    """A LoRA setting is out of range, or a target is unknown or matches no module of the model."""


# ---------------------------------------------------------------------------------------------- where targets sit
@dataclass(frozen=True)
class Block:
    """A place in a decoder layer that holds adapted modules.

    ``group``: the export group (one chunk per group and layer); ``hf_prefix``: module path under
    ``model.layers.{i}.``; ``megatron_prefix``: module path under ``decoder.layers.{i}.``.
    """

    group: str
    hf_prefix: str
    megatron_prefix: str


ATTENTION = Block("attention", "self_attn.", "self_attention.")
DENSE_MLP = Block("dense_mlp", "mlp.", "mlp.")
ROUTED_EXPERTS = Block("routed_experts", "block_sparse_moe.experts.", "mlp.experts.")
SHARED_EXPERTS = Block("shared_experts", "block_sparse_moe.shared_experts.", "mlp.shared_experts.")

# One chunk each per layer, in the order a layer's chunks are sent.
EXPORT_GROUPS: tuple[str, ...] = tuple(b.group for b in (ATTENTION, DENSE_MLP, ROUTED_EXPERTS, SHARED_EXPERTS))


class Placement(enum.Enum):
    """Which layers a target adapts, and in which block of each."""

    EVERY_LAYER = "the attention of every layer (KDA and MLA)"
    MLA_LAYERS = "the attention of MLA layers"
    MLP = "the dense layers' MLP and the MoE layers' shared experts"
    MOE_LAYERS = "the routed experts of MoE layers"

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every block this placement uses in some layer; the first is where the target's recipe name points."""
        if self is Placement.MLP:
            return (DENSE_MLP, SHARED_EXPERTS)
        return (ROUTED_EXPERTS,) if self is Placement.MOE_LAYERS else (ATTENTION,)

    def blocks_at(self, cfg: K3Config, layer: int) -> tuple[Block, ...]:
        """The blocks this placement uses in 0-based ``layer`` of a model of ``cfg`` (empty: none)."""
        moe = cfg.is_moe_layer(layer)
        if self is Placement.EVERY_LAYER:
            return (ATTENTION,)
        if self is Placement.MLA_LAYERS:
            return () if cfg.is_kda_layer(layer) else (ATTENTION,)
        if self is Placement.MOE_LAYERS:
            return (ROUTED_EXPERTS,) if moe else ()
        if not moe:
            return (DENSE_MLP,)
        return (SHARED_EXPERTS,) if cfg.num_shared_experts > 0 else ()


class ParallelStyle(enum.Enum):
    """How Megatron parallelizes the adapted linear (``k3.megatron.linears``). It fixes the adapter's
    communication (``k3.megatron.lora``) and each factor's layout over TP / EP (``k3.lora.sharding``)."""

    ROW_ALL_REDUCE = "row-parallel; the adapter's rank-r rows are all-reduced over TP"
    ROW_REDUCE_SCATTER = "row-parallel; the adapter's rank-r rows are reduce-scattered to the sequence shard"
    COLUMN = "column-parallel; B split on its output dim (each part of a fused linear separately)"
    DUPLICATED = "the whole base on every TP rank"
    EXPERT_FC1 = "routed experts' gate/up: A shared by all experts, B per expert, split over EP"
    EXPERT_FC2 = "routed experts' down: A per expert, split over EP, B shared by all experts"


class ModuleKind(enum.Enum):
    """What a target adapts in the reference model: a linear, or the stacked routed experts."""

    LINEAR = "linear"
    LATENT_EXPERTS = "latent_experts"


_EXPERT_STYLES = (ParallelStyle.EXPERT_FC1, ParallelStyle.EXPERT_FC2)


# ---------------------------------------------------------------------------------------------- one row
@dataclass(frozen=True)
class LoRATarget:
    """One LoRA target: a row of ``LORA_TARGETS``.

    Attributes:
        name: the recipe's target, the Megatron module under ``decoder.layers.*.`` in the placement's first block.
        placement: which layers it adapts, in which block (and so which export group).
        modules: the adapted HF modules under the block's ``hf_prefix`` (the routed experts' ``w1``/``w3``/``w2``
            are the PEFT names under the one experts module).
        serving_names: the HF target names the serving side knows it by (PEFT ``target_modules``); a PEFT config
            written elsewhere selects every target one of whose serving names it lists.
        factors: Megatron factor prefixes (``o`` -> ``o_lora_A``, ``o_lora_B``): one per module, or one for two
            modules Megatron fuses into one column-parallel linear (``fc1`` = ``[gate; up]``: one A, B stacked).
        style: how Megatron parallelizes the base linear.
        features: ``(in, out)`` features of one module at 0-based layer ``i`` of a model of the config.
        optional: the recipe lets ``k3 train`` leave it out.
    """

    name: str
    placement: Placement
    modules: tuple[str, ...]
    serving_names: tuple[str, ...]
    factors: tuple[str, ...]
    style: ParallelStyle
    features: Callable[[K3Config, int], tuple[int, int]]
    optional: bool = False

    def __post_init__(self) -> None:
        where = f"LoRA target {self.name!r}"
        if not self.modules or not self.serving_names or not self.factors:
            raise LoRAConfigError(f"{where}: modules, serving_names and factors must each name at least one")
        if (self.style in _EXPERT_STYLES) != (self.placement is Placement.MOE_LAYERS):
            raise LoRAConfigError(f"{where}: style {self.style.name} does not fit placement {self.placement.name} "
                                  "(the expert styles are exactly the routed experts')")
        fused = len(self.factors) == 1 and len(self.modules) == 2 and self.style is ParallelStyle.COLUMN
        if len(self.factors) != len(self.modules) and not fused:
            raise LoRAConfigError(f"{where}: {len(self.factors)} factors for {len(self.modules)} modules: expected "
                                  "one per module, or one for the two halves of a fused column-parallel linear")
        prefix = self.placement.blocks[0].megatron_prefix
        if not self.name.startswith(prefix) or "." in self.name[len(prefix):]:
            raise LoRAConfigError(f"{where}: expected {prefix}<module>, the Megatron module in "
                                  f"{self.placement.value}")

    @property
    def megatron_leaf(self) -> str:
        """The Megatron linear's name inside its block (``linear_fc1``)."""
        return self.name.rsplit(".", 1)[-1]

    @property
    def module_kind(self) -> ModuleKind:
        return ModuleKind.LATENT_EXPERTS if self.style in _EXPERT_STYLES else ModuleKind.LINEAR

    @property
    def fused(self) -> bool:
        """Megatron holds the modules as one linear with one factor pair (A shared, B stacked on dim 0)."""
        return len(self.factors) < len(self.modules)

    @property
    def shared_expert_factor(self) -> str | None:
        """``"A"`` or ``"B"``: the factor shared by all routed experts (exported with a leading expert dim of 1)."""
        return {ParallelStyle.EXPERT_FC1: "A", ParallelStyle.EXPERT_FC2: "B"}.get(self.style)

    def megatron_module(self, block: Block) -> str:
        """The adapted Megatron linear under ``decoder.layers.{i}.`` in ``block``."""
        return block.megatron_prefix + self.megatron_leaf

    def hf_modules(self, block: Block) -> tuple[str, ...]:
        """The adapted modules of the reference model under ``model.layers.{i}.`` in ``block``."""
        if self.module_kind is ModuleKind.LATENT_EXPERTS:
            return (block.hf_prefix.rstrip("."),)
        return tuple(block.hf_prefix + m for m in self.modules)

    def peft_modules(self, block: Block) -> tuple[str, ...]:
        """Module paths of the exported tensors (``<path>.lora_{A,B}.weight``) under ``model.layers.{i}.``."""
        return tuple(block.hf_prefix + m for m in self.modules)

    def peft_shapes(self, cfg: K3Config, layer: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Exported ``(lora_A, lora_B)`` shapes of each of this target's modules at 0-based ``layer``.

        Linear: A ``(r, in)``, B ``(out, r)``. Routed experts (E experts): fc1 A ``(1, r, in)``, B ``(E, out, r)``;
        fc2 A ``(E, r, in)``, B ``(1, out, r)``; the leading 1 of a shared factor is SGLang's serving contract.
        """
        fan_in, fan_out = self.features(cfg, layer)
        if self.style is ParallelStyle.EXPERT_FC1:
            return (1, rank, fan_in), (cfg.num_experts, fan_out, rank)
        if self.style is ParallelStyle.EXPERT_FC2:
            return (cfg.num_experts, rank, fan_in), (1, fan_out, rank)
        return (rank, fan_in), (fan_out, rank)


def _o_proj_in(cfg: K3Config, layer: int) -> int:
    return cfg.kda_proj_size if cfg.is_kda_layer(layer) else cfg.num_attention_heads * cfg.v_head_dim


def _mlp_width(cfg: K3Config, layer: int) -> int:
    return cfg.shared_expert_intermediate_size if cfg.is_moe_layer(layer) else cfg.intermediate_size


# ---------------------------------------------------------------------------------------------- the table
# The recipe's seven targets (K3:scripts/run_kimi_k3_lora.py), in the recipe's order: the order of a config's
# targets, of the PEFT target names and of the tensors inside a chunk.
LORA_TARGETS: tuple[LoRATarget, ...] = (
    LoRATarget(name="self_attention.o_proj", placement=Placement.EVERY_LAYER, modules=("o_proj",),
               serving_names=("o_proj",), factors=("o",), style=ParallelStyle.ROW_ALL_REDUCE,
               features=lambda c, i: (_o_proj_in(c, i), c.hidden_size)),
    LoRATarget(name="self_attention.q_a_proj", placement=Placement.MLA_LAYERS, modules=("q_a_proj",),
               serving_names=("q_a_proj",), factors=("q_a",), style=ParallelStyle.DUPLICATED,
               features=lambda c, i: (c.hidden_size, c.q_lora_rank)),
    LoRATarget(name="self_attention.kv_a_proj_with_mqa", placement=Placement.MLA_LAYERS,
               modules=("kv_a_proj_with_mqa",), serving_names=("kv_a_proj_with_mqa",), factors=("kv_a",),
               style=ParallelStyle.DUPLICATED,
               features=lambda c, i: (c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)),
    LoRATarget(name="mlp.linear_fc1", placement=Placement.MLP, modules=("gate_proj", "up_proj"),
               serving_names=("gate_proj", "up_proj"), factors=("fc1",), style=ParallelStyle.COLUMN,
               features=lambda c, i: (c.hidden_size, _mlp_width(c, i))),
    LoRATarget(name="mlp.linear_fc2", placement=Placement.MLP, modules=("down_proj",),
               serving_names=("down_proj",), factors=("fc2",), style=ParallelStyle.ROW_REDUCE_SCATTER,
               features=lambda c, i: (_mlp_width(c, i), c.hidden_size)),
    # Routed experts are served under the MLP's gate/up/down names (SGLang's MoE LoRA naming).
    LoRATarget(name="mlp.experts.linear_fc1", placement=Placement.MOE_LAYERS, modules=("w1", "w3"),
               serving_names=("gate_proj", "up_proj"), factors=("w1", "w3"), style=ParallelStyle.EXPERT_FC1,
               features=lambda c, i: (c.routed_expert_hidden_size, c.moe_intermediate_size)),
    LoRATarget(name="mlp.experts.linear_fc2", placement=Placement.MOE_LAYERS, modules=("w2",),
               serving_names=("down_proj",), factors=("w2",), style=ParallelStyle.EXPERT_FC2,
               features=lambda c, i: (c.moe_intermediate_size, c.routed_expert_hidden_size), optional=True),
)


def lora_targets() -> tuple[LoRATarget, ...]:
    """The table's rows, read when called (so every reader sees the same table)."""
    return LORA_TARGETS


def target_names() -> tuple[str, ...]:
    """Every target's name, in table order (the default ``target_modules``)."""
    return tuple(t.name for t in lora_targets())


def optional_target_names() -> tuple[str, ...]:
    """The targets the recipe lets ``k3 train`` leave out."""
    return tuple(t.name for t in lora_targets() if t.optional)


def lora_target(name: str) -> LoRATarget:
    """The row of target ``name`` (``decoder.layers.*.`` prefix optional); ``LoRAConfigError`` if unknown."""
    short = name[len(MEGATRON_PREFIX):] if name.startswith(MEGATRON_PREFIX) else name
    for target in lora_targets():
        if target.name == short:
            return target
    raise LoRAConfigError(f"LoRA target {name!r} is unknown: expected one of {list(target_names())} "
                          f"(optionally prefixed {MEGATRON_PREFIX!r})")


# ---------------------------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class LoRAConfig:
    """Adapter hyper-parameters and targets.

    The defaults are the public K3 launcher's (rank 16, alpha 32, dropout 0, every target of the table: the
    recipe's seven); the validated run used rank 32 / alpha 64.

    Attributes:
        rank: adapter rank r (> 0).
        alpha: ``lora_alpha``; the adapter output is scaled by ``alpha / rank``.
        dropout: dropout probability on the adapter input, applied in training mode only (0 <= p < 1).
        target_modules: target names (rows of ``LORA_TARGETS``, ``decoder.layers.*.`` prefix optional);
            normalized to the short form, in table order, duplicates removed.
        experts_shared_outer: the routed-expert layout. Only the shared-outer layout exists (the recipe makes
            ``--experts-shared-outer-loras`` mandatory, and it is SGLang's serving contract), so this must be True.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default_factory=target_names)
    experts_shared_outer: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoRAConfigError(f"LoRAConfig.rank={self.rank!r}: expected an integer >= 1")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise LoRAConfigError(f"LoRAConfig.alpha={self.alpha!r}: expected a number > 0")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoRAConfigError(f"LoRAConfig.dropout={self.dropout!r}: expected 0 <= dropout < 1")
        if isinstance(self.target_modules, str):
            raise LoRAConfigError(
                f"LoRAConfig.target_modules={self.target_modules!r}: expected a list of target names, not a string"
            )
        if not self.target_modules:
            raise LoRAConfigError("LoRAConfig.target_modules is empty: expected at least one target")
        given = {lora_target(t).name for t in self.target_modules}
        object.__setattr__(self, "target_modules", tuple(n for n in target_names() if n in given))
        if self.experts_shared_outer is not True:
            raise LoRAConfigError(
                "LoRAConfig.experts_shared_outer=False: only the shared-outer expert layout is implemented "
                "(the recipe requires --experts-shared-outer-loras)"
            )

    @property
    def scale(self) -> float:
        """The factor on the adapter delta, ``alpha / rank``."""
        return float(self.alpha) / self.rank

    @property
    def targets(self) -> tuple[LoRATarget, ...]:
        """The rows of ``target_modules``, in table order."""
        return tuple(lora_target(n) for n in self.target_modules)

    def hf_target_modules(self) -> list[str]:
        """HF module names the serving side targets (the list miles sends to SGLang): the targets' serving names,
        in table order, each once."""
        names: list[str] = []
        for target in self.targets:
            names += [n for n in target.serving_names if n not in names]
        return names

    def peft_config(self) -> dict[str, Any]:
        """The config dict sent with every chunk and written as ``adapter_config.json`` (PEFT ``LoraConfig`` keys)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.hf_target_modules(),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "experts_shared_outer_loras": True,
            # Our exact targets: the HF names above cannot tell dense/shared MLPs from routed experts.
            "k3_target_modules": list(self.target_modules),
        }

    @classmethod
    def from_peft_config(cls, d: dict[str, Any], where: str = "adapter config") -> "LoRAConfig":
        """Read back ``peft_config()`` output. Without our ``k3_target_modules`` key (a config written elsewhere),
        every target one of whose serving names the HF ``target_modules`` lists is selected: routed experts share
        their names with the MLPs, so both are."""
        if d.get("peft_type") != "LORA":
            raise LoRAConfigError(f"{where}: peft_type={d.get('peft_type')!r}: expected 'LORA'")
        for key in ("r", "lora_alpha"):
            if key not in d:
                raise LoRAConfigError(f"{where}: missing {key!r}")
        if d.get("bias", "none") != "none":
            raise LoRAConfigError(f"{where}: bias={d['bias']!r}: expected 'none'")
        if d.get("use_dora") or d.get("use_rslora"):
            raise LoRAConfigError(f"{where}: use_dora/use_rslora are set: plain LoRA only")
        rank, alpha, dropout = int(d["r"]), float(d["lora_alpha"]), float(d.get("lora_dropout", 0.0))
        if d.get("k3_target_modules"):
            return cls(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(d["k3_target_modules"]))
        hf = set(d.get("target_modules") or [])
        targets = tuple(t.name for t in lora_targets() if hf.intersection(t.serving_names))
        if not targets:
            raise LoRAConfigError(f"{where}: target_modules={sorted(hf)}: none of them is a K3 LoRA target")
        return cls(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets)
