"""How each LoRA factor is laid out over tensor (TP) and expert (EP) parallelism — pure functions (recipe §4.2).

For every adapter factor, by its Megatron name (``o_lora_A``, ``fc1_lora_B``, ``w2_lora_B``, ...), a
``FactorRule`` says which dimension is split over which group (or that it is replicated) and which group its
gradient must be summed over, on top of the usual data-parallel reduction. The rules follow from the parallel
style of the target's base linear (a row of ``k3/settings/lora.py``):

| style | ``<f>_lora_A`` | ``<f>_lora_B`` |
|---|---|---|
| row, all-reduce (``o``) | split dim 1 over TP (like the row-parallel base input) | replicated |
| row, reduce-scatter (``fc2``) | split dim 1 over TP | replicated; gradient summed over TP, only with SP |
| column (``fc1``) | replicated; gradient summed over TP | split dim 0 over TP; a fused ``[gate; up]`` splits each half, local = ``[gate_t; up_t]`` |
| duplicated (``q_a``, ``kv_a``) | replicated; gradient summed over TP | replicated; gradient summed over TP |
| expert fc1 (``w1``, ``w3``) | ``(r, latent)`` shared by all experts, replicated on every EP rank; summed over EP | ``(E, F, r)`` split dim 0 over EP (E/EP local experts) |
| expert fc2 (``w2``) | ``(E, r, F)`` split dim 0 over EP | ``(latent, r)`` shared, replicated; summed over EP |

With the recipe's targets:

| factor | global shape | layout | gradient summed over |
|---|---|---|---|
| ``o_lora_A`` | (r, 12288) | split dim 1 over TP | — |
| ``o_lora_B`` | (hidden, r) | replicated | — |
| ``q_a_lora_A/B``, ``kv_a_lora_A/B`` | (r, hidden) / (1536 or 576, r) | replicated (the base is duplicated) | TP |
| ``fc1_lora_A`` | (r, hidden) | replicated | TP |
| ``fc1_lora_B`` | (2F, r) = [gate; up] | each half split on dim 0 over TP; local = [gate_t; up_t] | — |
| ``fc2_lora_A`` | (r, F) | split dim 1 over TP | — |
| ``fc2_lora_B`` | (hidden, r) | replicated | TP, only with sequence parallelism |
| ``w1_lora_A``, ``w3_lora_A`` | (r, latent) | shared by all experts, replicated on every EP rank | EP |
| ``w1_lora_B``, ``w3_lora_B`` | (E, F, r) | split dim 0 over EP (E/EP local experts) | — |
| ``w2_lora_A`` | (E, r, F) | split dim 0 over EP | — |
| ``w2_lora_B`` | (latent, r) | shared, replicated | EP |

Why the sums: a replicated factor whose consumers are sharded sees only its rank's share of the gradient
(a column-parallel A feeds TP-sharded B rows; q_a's and kv_a's adapters feed a duplicated projection whose output
goes through the norm into the column-parallel q_b / kv_b, so each rank back-propagates only its columns' part of
the output gradient; an expert's shared A feeds only the EP rank's local experts' tokens; fc2's B under SP
sees only the rank's sequence shard), so the true gradient is the sum over that group.
Experts need ETP = 1. ``shard`` and ``gather`` are exact inverses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from k3.settings.lora import LoRATarget, ParallelStyle, lora_targets

__all__ = ["ParallelLayout", "FactorRule", "factor_rules", "factor_rule", "local_shape", "shard", "gather",
           "grad_sum_group", "ShardingError"]

Group = Literal["tp", "ep"]


class ShardingError(ValueError):
    """A layout the adapters cannot be split over (indivisible dims, ETP != 1, unknown factor)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Group sizes: ``tp`` tensor parallel, ``ep`` expert parallel, ``etp`` expert tensor parallel (must be 1)."""

    tp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShardingError(f"ParallelLayout.{name}={v!r}: expected an integer >= 1")
        if self.etp != 1:
            raise ShardingError(f"ParallelLayout.etp={self.etp}: shared-outer expert LoRA needs ETP = 1")

    def size(self, group: Group) -> int:
        return self.tp if group == "tp" else self.ep


@dataclass(frozen=True)
class FactorRule:
    """Layout of one adapter factor.

    ``split_dim``/``split_group``: the dimension split evenly over the group (None: replicated).
    ``halves``: the split dimension holds two stacked halves ([gate; up]) that are split separately.
    ``grad_sum``: the group the gradient is all-reduce-summed over, beyond data parallelism (None: none).
    ``grad_sum_needs_sp``: that sum applies only with sequence parallelism.
    """

    factor: str
    split_dim: int | None
    split_group: Group | None
    grad_sum: Group | None = None
    grad_sum_needs_sp: bool = False
    halves: bool = False

    @property
    def replicated(self) -> bool:
        return self.split_group is None


# Parallel style -> the layout of (A, B): FactorRule fields (unset: replicated, no extra gradient sum).
_STYLE_LAYOUTS: dict[ParallelStyle, tuple[dict, dict]] = {
    ParallelStyle.ROW_ALL_REDUCE: ({"split_dim": 1, "split_group": "tp"}, {}),
    ParallelStyle.ROW_REDUCE_SCATTER: ({"split_dim": 1, "split_group": "tp"},
                                       {"grad_sum": "tp", "grad_sum_needs_sp": True}),
    ParallelStyle.COLUMN: ({"grad_sum": "tp"}, {"split_dim": 0, "split_group": "tp"}),
    ParallelStyle.DUPLICATED: ({"grad_sum": "tp"}, {"grad_sum": "tp"}),
    ParallelStyle.EXPERT_FC1: ({"grad_sum": "ep"}, {"split_dim": 0, "split_group": "ep"}),
    ParallelStyle.EXPERT_FC2: ({"split_dim": 0, "split_group": "ep"}, {"grad_sum": "ep"}),
}


def _rules(target: LoRATarget) -> list[FactorRule]:
    """The A and B rules of each of the target's factors, from its parallel style; a fused target's split B
    holds its modules' parts stacked (``halves``)."""
    a, b = _STYLE_LAYOUTS[target.style]
    halves = {"halves": True} if target.fused and "split_dim" in b else {}
    unset = {"split_dim": None, "split_group": None}
    return [rule for f in target.factors for rule in (FactorRule(f"{f}_lora_A", **{**unset, **a}),
                                                      FactorRule(f"{f}_lora_B", **{**unset, **b, **halves}))]


@functools.lru_cache(maxsize=4)
def _rules_of(table: tuple[LoRATarget, ...]) -> dict[str, FactorRule]:
    rules: dict[str, FactorRule] = {}
    for target in table:
        for rule in _rules(target):
            if rules.setdefault(rule.factor, rule) != rule:
                raise ShardingError(f"LoRA factor {rule.factor} has two layouts: its prefix is used by two targets "
                                    "of different styles")
    return rules


def factor_rules() -> dict[str, FactorRule]:
    """Every factor's rule, by Megatron factor name, from the target table."""
    return dict(_rules_of(lora_targets()))


def factor_rule(factor: str) -> FactorRule:
    """The rule for a Megatron factor name (see the module table); unknown names raise."""
    rules = _rules_of(lora_targets())
    try:
        return rules[factor]
    except KeyError:
        raise ShardingError(f"unknown LoRA factor {factor!r}: expected one of {sorted(rules)}") from None


def grad_sum_group(factor: str, layout: ParallelLayout) -> Group | None:
    """The group this factor's gradient is summed over under ``layout`` (None: no extra reduction).

    A group of size 1 is still returned (the sum is then the identity); callers skip it if they like.
    """
    rule = factor_rule(factor)
    if rule.grad_sum_needs_sp and not layout.sequence_parallel:
        return None
    return rule.grad_sum


def local_shape(factor: str, global_shape: Sequence[int], layout: ParallelLayout) -> tuple[int, ...]:
    """Shape of one rank's piece of a factor with ``global_shape`` under ``layout``."""
    rule = factor_rule(factor)
    shape = list(global_shape)
    if rule.replicated:
        return tuple(shape)
    n = layout.size(rule.split_group)
    _check_divisible(rule, shape, n)
    shape[rule.split_dim] //= n
    return tuple(shape)


def _check_divisible(rule: FactorRule, shape: list[int], n: int) -> None:
    if rule.split_dim >= len(shape):
        raise ShardingError(f"{rule.factor}: shape {tuple(shape)} has no dim {rule.split_dim} to split")
    size = shape[rule.split_dim]
    unit = 2 * n if rule.halves else n
    if size % unit:
        what = f"each half ({size // 2})" if rule.halves else f"dim {rule.split_dim} ({size})"
        raise ShardingError(f"{rule.factor}: {what} of shape {tuple(shape)} is not divisible by "
                            f"{rule.split_group.upper()}={n}")


def shard(tensor: torch.Tensor, factor: str, layout: ParallelLayout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece (rank within the factor's split group) of the full ``tensor``; a contiguous copy.

    Replicated factors return a copy of the whole tensor for every rank.
    """
    rule = factor_rule(factor)
    if rule.replicated:
        return tensor.clone()
    n = layout.size(rule.split_group)
    if not 0 <= rank < n:
        raise ShardingError(f"{factor}: rank {rank} outside the {rule.split_group.upper()} group of size {n}")
    _check_divisible(rule, list(tensor.shape), n)
    if rule.halves:
        gate, up = tensor.chunk(2, dim=rule.split_dim)
        return torch.cat([gate.chunk(n, dim=rule.split_dim)[rank], up.chunk(n, dim=rule.split_dim)[rank]],
                         dim=rule.split_dim).contiguous()
    return tensor.chunk(n, dim=rule.split_dim)[rank].contiguous()


def gather(shards: Sequence[torch.Tensor], factor: str) -> torch.Tensor:
    """The full factor from every rank's piece, in rank order (inverse of ``shard``).

    Replicated factors require identical pieces (a mismatch means the replicas drifted apart) and return one.
    """
    rule = factor_rule(factor)
    if not shards:
        raise ShardingError(f"{factor}: no shards to gather")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ShardingError(f"{factor}: shards have different shapes {sorted(shapes)}")
    if rule.replicated:
        first = shards[0]
        for i, s in enumerate(shards[1:], start=1):
            if not torch.equal(s, first):
                raise ShardingError(f"{factor} is replicated but the piece of rank {i} differs from rank 0's")
        return first.clone()
    d = rule.split_dim
    if rule.halves:
        halves = [s.chunk(2, dim=d) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=d)
    return torch.cat(list(shards), dim=d)
