"""The linear layers of K3's megatron modules and the one rule for their communication.

A K3 block that starts with projections (KDA, MLA, a SiTU MLP) *enters the tensor-parallel region once*:
``enter_tp_region`` all-gathers the sequence-parallel input (backward: reduce-scatter) or, without sequence
parallelism, marks the replicated input (backward: all-reduce). Inside the region every consumer of that input
produces only its rank's share of the input gradient, and the projections do no communication of their own:

- ``ColumnParallel``: megatron's ``ColumnParallelLinear`` with its input communication turned off;
- ``DuplicatedLinear``: a full weight on every TP rank (K3's ``q_a``/``kv_a``/``f_a``). It feeds
  column-parallel consumers, so its output gradient, its input-gradient share and its weight gradient are
  per-rank shares: the weight's gradient is summed over TP (``k3_grad_sum = "tp"``, see ``k3.megatron.grads``);
- ``RowParallel``: megatron's ``RowParallelLinear``; it leaves the region (reduce-scatter to the sequence
  shard with sequence parallelism, all-reduce without).

Routed experts run outside the region on dispatched tokens: ``GroupedExpertLinear`` holds the local experts'
weights stacked ``[local_experts, out, in]`` and runs one grouped GEMM.

Every linear here returns a tensor (not megatron's ``(out, bias)``) and adds its LoRA delta when an adapter is
attached as ``self.lora`` (``k3.megatron.lora``); adapters never enter the base model's sharded state dict.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from k3.kernels.grouped_mm import grouped_mm

__all__ = [
    "enter_tp_region",
    "ColumnParallel",
    "RowParallel",
    "DuplicatedLinear",
    "GroupedExpertLinear",
    "mark_grad_sum",
    "mark_sequence_parallel",
    "init_normal",
    "without_adapters",
]

INIT_STD = 0.02


def init_normal(t: torch.Tensor) -> None:
    """The init of every K3 projection: N(0, 0.02²) (the reference model's)."""
    nn.init.normal_(t, std=INIT_STD)


def mark_grad_sum(param: torch.Tensor, group: str) -> None:
    """Tag ``param``'s gradient to be summed over ``group`` (``"tp"`` or ``"ep"``) before the DP reduction."""
    if group not in ("tp", "ep"):
        raise ValueError(f"mark_grad_sum: group={group!r}: expected 'tp' or 'ep'")
    param.k3_grad_sum = group


def mark_sequence_parallel(module: nn.Module, config: TransformerConfig) -> None:
    """Tag ``module``'s own parameters as working on sequence-parallel token shards: megatron sums their
    gradients over TP when sequence parallelism is on (``finalize_model_grads``)."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = config.sequence_parallel


def without_adapters(sharded: dict) -> dict:
    """Drop LoRA adapter entries (``….lora.…``) from a (sharded) state dict: the base checkpoint has none."""
    return {k: v for k, v in sharded.items() if ".lora." not in f".{k}"}


def enter_tp_region(x: torch.Tensor, config: TransformerConfig, tp_group) -> torch.Tensor:
    """``x`` ``[s/tp, b, h]`` (SP) or ``[s, b, h]`` -> the full-sequence input ``[s, b, h]`` of a TP block."""
    if tp_group.size() == 1:
        return x
    if config.sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(x, group=tp_group)
    return tensor_parallel.copy_to_tensor_model_parallel_region(x, group=tp_group)


class ColumnParallel(tensor_parallel.ColumnParallelLinear):
    """Column-parallel (``weight [out/tp, in]``) for use inside a TP region: ``x [..., in]`` -> ``[..., out/tp]``."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig, tp_group) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_normal, bias=False,
                         gather_output=False, skip_bias_add=True, disable_grad_reduce=True, tp_group=tp_group)
        self.sequence_parallel = False  # the input is already gathered by enter_tp_region
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)[0]
        return out if self.lora is None else out + self.lora(x)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return without_adapters(super().sharded_state_dict(prefix, sharded_offsets, metadata))


class RowParallel(tensor_parallel.RowParallelLinear):
    """Row-parallel (``weight [out, in/tp]``) leaving the TP region: ``x [s, b, in/tp]`` -> ``[s/tp, b, out]``
    with sequence parallelism, ``[s, b, out]`` (all-reduced) without."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig, tp_group) -> None:
        super().__init__(input_size, output_size, config=config, init_method=init_normal, bias=False,
                         input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)[0]
        return out if self.lora is None else out + self.lora(x)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return without_adapters(super().sharded_state_dict(prefix, sharded_offsets, metadata))


class DuplicatedLinear(nn.Module):
    """A bias-free linear whose full ``weight [out, in]`` sits on every TP rank (gradient summed over TP)."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_normal(self.weight)
        mark_grad_sum(self.weight, "tp")
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        out = nn.functional.linear(x, self.weight)
        return out if self.lora is None else out + self.lora(x)


class GroupedExpertLinear(nn.Module):
    """The local routed experts' weights of one projection, stacked ``weight [local_experts, out, in]``.

    The weight is an expert parameter (``allreduce = False``): megatron reduces its gradient over the
    expert-data-parallel group, which also holds the TP ranks (experts are not tensor-parallel).
    """

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, config: TransformerConfig,
                 ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.weight = nn.Parameter(torch.empty(num_local_experts, output_size, input_size,
                                               dtype=config.params_dtype))
        if config.perform_initialization:
            init_normal(self.weight)
        self.weight.allreduce = False
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [rows, in]`` sorted by local expert, ``counts [local_experts]`` -> ``[rows, out]``."""
        if self.lora is not None and self.lora.adds_into_base(x):  # the adapter's kernels add into the base
            return self.lora.base_plus_delta(x, self.weight, counts)
        out = grouped_mm(x, self.weight, counts)
        return out if self.lora is None else out + self.lora(x, counts)

    def extra_repr(self) -> str:
        e, out, inp = self.weight.shape
        return f"local_experts={e}, in={inp}, out={out}"
