"""LoRA on the K3 megatron modules under TP and EP (recipe §4.1-4.2; layouts from ``k3.lora.sharding``).

``apply_megatron_lora`` freezes the model and attaches an adapter as ``linear.lora`` at the configured targets:
each target's Megatron module in every block its placement gives a layer (the target table,
``k3/settings/lora.py``: ``mlp.linear_fc1/fc2`` also cover the MoE layers' shared experts). Each adapter holds
its factors under the table's names (``o_lora_A``, ``fc1_lora_B``, ``w1_lora_A`` …), so a parameter's last name
component is its ``k3.lora.sharding`` factor, and computes its delta with the communication its base needs, by
the target's parallel style:

| style (base module) | adapter | delta | communication |
|---|---|---|---|
| row, all-reduce (``o_proj``) | ``RowParallelLoRA`` | ``B · allreduce(A_t x_t)``, then the rank's SP shard | all-reduce of r-wide rows |
| row, reduce-scatter (``linear_fc2``) | ``RowParallelLoRA`` | ``B · reduce_scatter(A_t x_t)`` (all-reduce without SP) | r-wide rows |
| column (``linear_fc1``) | ``ReplicatedInputLoRA`` | ``B_t · (A x)`` on the gathered input | none (inside the TP region) |
| duplicated (``q_a``/``kv_a``) | ``ReplicatedInputLoRA`` | ``B · (A x)`` on the gathered input | none (inside the TP region) |
| expert fc1 / fc2 | ``ExpertFc1LoRA`` / ``ExpertFc2LoRA`` | shared-outer grouped GEMMs on the dispatched rows (``expert_lora_kernel``) | none (outside TP) |

Gradients: factors tagged ``k3_grad_sum`` are summed over TP / EP by ``k3.megatron.grads`` before megatron's
data-parallel reduction, as ``k3.lora.sharding`` prescribes (inside the TP region every consumer of the
gathered input yields only its rank's gradient share, ``k3.megatron.linears``: hence the TP sums of fc1's A and
of the duplicated ``q_a``/``kv_a`` adapters' factors). Routed-expert factors, shared or not, are expert
parameters (reduced over expert-data-parallel ranks by megatron), marked so that megatron's gradient norm (the
global-norm clip) counts each once under every layout (``mark_expert_factor``).

Initial values are drawn from the *global* factor with a generator seeded by ``seed`` and the factor's
global name, then sharded: the same ``seed`` gives the same adapters under every layout.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from k3.kernels.expert_lora import function as expert_lora
from k3.kernels.grouped_mm import grouped_mm
from k3.lora.sharding import ParallelLayout, factor_rule, gather, grad_sum_group, local_shape, shard
from k3.megatron.linears import ColumnParallel, DuplicatedLinear, GroupedExpertLinear, RowParallel, mark_grad_sum
from k3.settings.lora import LoRAConfig, LoRAConfigError, LoRATarget, ParallelStyle

__all__ = ["BASE_CLASSES", "ExpertFc1LoRA", "ExpertFc2LoRA", "ExpertLoRA", "LoRAAdapter", "ParallelContext",
           "apply_megatron_lora", "gather_lora", "iter_lora", "load_lora", "lora_factors", "lora_parameters",
           "mark_expert_factor"]


class ParallelContext:
    """The layout and this rank's place in it, as the adapters need them."""

    def __init__(self, pg_collection, sequence_parallel: bool) -> None:
        self.tp_group, self.ep_group = pg_collection.tp, pg_collection.ep
        self.layout = ParallelLayout(tp=self.tp_group.size(), ep=self.ep_group.size(),
                                     sequence_parallel=sequence_parallel and self.tp_group.size() > 1)

    def rank_in(self, group: str | None) -> int:
        return {"tp": self.tp_group.rank(), "ep": self.ep_group.rank(), None: 0}[group]


class LoRAAdapter(nn.Module):
    """Base of the adapters: owns the factors, the scale ``alpha / r`` and the input dropout."""

    def __init__(self, lora: LoRAConfig, ctx: ParallelContext, global_name: str, seed: int) -> None:
        super().__init__()
        self.rank, self.scale, self.dropout = lora.rank, lora.scale, lora.dropout
        self.ctx, self.global_name, self.seed = ctx, global_name, seed

    def add_factor(self, factor: str, global_shape: tuple[int, ...], like: torch.Tensor,
                   xavier_fan_in: int | None = None) -> nn.Parameter:
        """Register ``factor`` (this rank's piece of ``global_shape``); A factors are Xavier-uniform over each
        ``[r, fan_in]`` slice, B factors zero."""
        rule = factor_rule(factor)
        if xavier_fan_in is None:
            piece = torch.zeros(local_shape(factor, global_shape, self.ctx.layout))
        else:
            gen = torch.Generator().manual_seed(self.seed ^ zlib.crc32(f"{self.global_name}.{factor}".encode()))
            bound = math.sqrt(6.0 / (xavier_fan_in + self.rank))
            full = torch.empty(global_shape).uniform_(-bound, bound, generator=gen)
            piece = shard(full, factor, self.ctx.layout, self.ctx.rank_in(rule.split_group))
        param = nn.Parameter(piece.to(device=like.device, dtype=like.dtype))
        if rule.split_group == "tp":
            set_tensor_model_parallel_attributes(param, True, rule.split_dim, 1)
        group = grad_sum_group(factor, self.ctx.layout)
        if group is not None and self.ctx.layout.size(group) > 1:
            mark_grad_sum(param, group)
        param.k3_lora_factor = factor
        self.register_parameter(factor, param)
        return param

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter input (training only). The default generator is seeded alike on the TP
        ranks, so a replicated input gets the same mask on each; split inputs override this."""
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


class ReplicatedInputLoRA(LoRAAdapter):
    """Column-parallel or duplicated base, full input inside the TP region: ``delta = s · B (A x)``.

    ``prefix`` is the factor prefix (``fc1``, ``q_a``, ``kv_a``); ``B`` is this rank's rows of the base output
    (all rows for a duplicated base; ``[gate_t; up_t]`` for fc1).
    """

    def __init__(self, base: ColumnParallel | DuplicatedLinear, prefix: str, global_out: int, **kw) -> None:
        super().__init__(**kw)
        w = base.weight
        self.a_name, self.b_name = f"{prefix}_lora_A", f"{prefix}_lora_B"
        self.add_factor(self.a_name, (self.rank, w.shape[1]), w, xavier_fan_in=w.shape[1])
        self.add_factor(self.b_name, (global_out, self.rank), w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(self.adapter_input(x), getattr(self, self.a_name))
        return self.scale * F.linear(u, getattr(self, self.b_name))


class RowParallelLoRA(LoRAAdapter):
    """Row-parallel base: ``A`` split like the base input, ``B`` replicated.

    ``reduce="all_reduce"`` (o_proj): ``u = allreduce(A_t x_t)`` on the full sequence, ``delta = B u``, then the
    rank's sequence shard. ``reduce="reduce_scatter"`` (fc2): ``u`` reduce-scattered to the sequence shard
    first, then ``B`` (whose gradient is then summed over TP).
    """

    def __init__(self, base: RowParallel, prefix: str, global_in: int, reduce: str, **kw) -> None:
        super().__init__(**kw)
        w = base.weight
        self.a_name, self.b_name = f"{prefix}_lora_A", f"{prefix}_lora_B"
        self.reduce = reduce
        self.add_factor(self.a_name, (self.rank, global_in), w, xavier_fan_in=global_in)
        self.add_factor(self.b_name, (w.shape[0], self.rank), w)

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout == 0 or not self.training:
            return x
        with tensor_parallel.get_cuda_rng_tracker().fork():  # the input is split over TP: masks per rank
            return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [s, b, in/tp]`` -> delta in the base output's layout (``[s/tp, b, out]`` with SP)."""
        u = F.linear(self.adapter_input(x), getattr(self, self.a_name))
        tp, sp = self.ctx.tp_group, self.ctx.layout.sequence_parallel
        if tp.size() > 1 and sp and self.reduce == "reduce_scatter":
            u = tensor_parallel.reduce_scatter_to_sequence_parallel_region(u, group=tp)
            return self.scale * F.linear(u, getattr(self, self.b_name))
        if tp.size() > 1:
            u = tensor_parallel.reduce_from_tensor_model_parallel_region(u, group=tp)
        delta = self.scale * F.linear(u, getattr(self, self.b_name))
        if tp.size() > 1 and sp:
            delta = tensor_parallel.scatter_to_sequence_parallel_region(delta, group=tp)
        return delta


def mark_expert_factor(param: nn.Parameter, ctx: ParallelContext) -> None:
    """Make a routed-expert factor an expert parameter of megatron's and count it once in the gradient norm.

    ``allreduce = False``: DDP reduces it over the expert-data-parallel ranks, the optimizer puts it in the
    expert optimizer. That optimizer's gradient norm is summed over EP (× ETP × PP) only, while megatron skips a
    parameter without ``tensor_model_parallel`` on TP ranks > 0: with ETP 1 every TP rank holds the same expert
    factors (not TP duplicates to skip), so they are marked ``tensor_model_parallel``, as megatron's own
    expert weights are; and a factor shared by all experts is on every EP rank, so it is counted on EP rank 0
    only (``shared`` elsewhere). Without both, the TP ranks clip with different norms and EP over-counts."""
    param.allreduce = False
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    if factor_rule(param.k3_lora_factor).split_group is None and ctx.rank_in("ep") > 0:
        param.shared = True


class ExpertLoRA(LoRAAdapter):
    """Base of the routed-expert adapters: which kernels run their rank-r grouped GEMMs.

    ``kernel="torch"``: ``forward`` returns the delta and the base adds it (torch's grouped GEMM). ``"triton"``:
    ``base_plus_delta`` runs the base grouped GEMM and adds the adapter into its output (and into its input
    gradient) in the Triton kernels' epilogues (``k3/kernels/expert_lora/``), except while dropout is active.
    """

    def __init__(self, kernel: str = "torch", **kw) -> None:
        super().__init__(**kw)
        expert_lora.check_kernel_choice(kernel, flag="expert_lora_kernel")
        self.kernel = kernel

    def adds_into_base(self, x: torch.Tensor) -> bool:
        """Whether the base's forward goes through ``base_plus_delta`` for these rows; a ValueError where the
        Triton kernels were asked for and cannot run on ``x``'s device."""
        return expert_lora.kernels_run(self.kernel, x.device, self.dropout > 0 and self.training,
                                        flag="expert_lora_kernel")

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}, kernel={self.kernel}"


class ExpertFc1LoRA(ExpertLoRA):
    """Routed experts' gate/up: shared ``w1_lora_A``/``w3_lora_A`` [r, Lt], per-expert ``w1_lora_B``/``w3_lora_B``
    [E_local, F, r]; ``delta_e = s · [B1_e (A1 x) | B3_e (A3 x)]`` (the fc1 output layout ``[gate | up]``)."""

    def __init__(self, base: GroupedExpertLinear, num_experts: int, **kw) -> None:
        super().__init__(**kw)
        w = base.weight  # [E_local, 2F, Lt]
        F_, Lt = w.shape[1] // 2, w.shape[2]
        for name in ("w1", "w3"):
            self.add_factor(f"{name}_lora_A", (self.rank, Lt), w, xavier_fan_in=Lt)
        for name in ("w1", "w3"):
            self.add_factor(f"{name}_lora_B", (num_experts, F_, self.rank), w)
        for p in self.parameters(recurse=False):
            mark_expert_factor(p, self.ctx)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        u = self.adapter_input(x) @ torch.cat([self.w1_lora_A, self.w3_lora_A]).t()  # [rows, 2r]: one GEMM
        u1, u3 = u.split(self.rank, dim=-1)
        return self.scale * torch.cat([grouped_mm(u1, self.w1_lora_B, counts),
                                       grouped_mm(u3, self.w3_lora_B, counts)], dim=-1)

    def base_plus_delta(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``grouped(x, weight) + forward(x, counts)`` on the Triton kernels; ``weight [E_local, 2F, Lt]``."""
        return expert_lora.lora_fc1(x, torch.cat([self.w1_lora_A, self.w3_lora_A]), self.w1_lora_B,
                                     self.w3_lora_B, weight, counts, self.scale)


class ExpertFc2LoRA(ExpertLoRA):
    """Routed experts' down: per-expert ``w2_lora_A`` [E_local, r, F], shared ``w2_lora_B`` [Lt, r];
    ``delta_e = s · B2 (A2_e h)``."""

    def __init__(self, base: GroupedExpertLinear, num_experts: int, **kw) -> None:
        super().__init__(**kw)
        w = base.weight  # [E_local, Lt, F]
        Lt, F_ = w.shape[1], w.shape[2]
        self.add_factor("w2_lora_A", (num_experts, self.rank, F_), w, xavier_fan_in=F_)
        self.add_factor("w2_lora_B", (Lt, self.rank), w)
        for p in self.parameters(recurse=False):
            mark_expert_factor(p, self.ctx)

    def forward(self, h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        u = grouped_mm(self.adapter_input(h), self.w2_lora_A, counts)  # [rows, r]
        return self.scale * F.linear(u, self.w2_lora_B)

    def base_plus_delta(self, h: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``grouped(h, weight) + forward(h, counts)`` on the Triton kernels; ``weight [E_local, Lt, F]``."""
        return expert_lora.lora_down(h, self.w2_lora_A, self.w2_lora_B, weight, counts, self.scale)


def _layers(model: nn.Module):
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise LoRAConfigError(f"apply_megatron_lora: {type(model).__name__} has no .decoder (expected the GPTModel "
                              "from k3_model_provider)")
    return decoder.layers


# Parallel style -> the megatron linear it adapts.
BASE_CLASSES: dict[ParallelStyle, type[nn.Module]] = {
    ParallelStyle.ROW_ALL_REDUCE: RowParallel,
    ParallelStyle.ROW_REDUCE_SCATTER: RowParallel,
    ParallelStyle.COLUMN: ColumnParallel,
    ParallelStyle.DUPLICATED: DuplicatedLinear,
    ParallelStyle.EXPERT_FC1: GroupedExpertLinear,
    ParallelStyle.EXPERT_FC2: GroupedExpertLinear,
}


def _new_adapter(target: LoRATarget, linear: nn.Module, num_experts: int, expert_lora_kernel: str,
                 **common) -> LoRAAdapter:
    """The adapter of ``target``'s style on ``linear``; ``common``: ``LoRAAdapter``'s keyword arguments."""
    style, prefix = target.style, target.factors[0]
    if style is ParallelStyle.ROW_ALL_REDUCE:
        return RowParallelLoRA(linear, prefix=prefix, global_in=linear.input_size, reduce="all_reduce", **common)
    if style is ParallelStyle.ROW_REDUCE_SCATTER:
        return RowParallelLoRA(linear, prefix=prefix, global_in=linear.input_size, reduce="reduce_scatter",
                               **common)
    if style is ParallelStyle.COLUMN:
        return ReplicatedInputLoRA(linear, prefix=prefix, global_out=linear.output_size, **common)
    if style is ParallelStyle.DUPLICATED:
        return ReplicatedInputLoRA(linear, prefix=prefix, global_out=linear.weight.shape[0], **common)
    fc = ExpertFc1LoRA if style is ParallelStyle.EXPERT_FC1 else ExpertFc2LoRA
    return fc(linear, num_experts=num_experts, kernel=expert_lora_kernel, **common)


def apply_megatron_lora(model: nn.Module, lora: LoRAConfig, seed: int = 0,
                        expert_lora_kernel: str = "torch") -> list[str]:
    """Freeze ``model`` (a ``k3_model_provider`` stage) and attach adapters at ``lora.target_modules``.

    ``expert_lora_kernel``: ``"torch"``, ``"triton"`` or ``"auto"``, how the routed-expert adapters run their
    rank-r grouped GEMMs (``ExpertLoRA``; the same adapters and math either way).

    Returns the global names of the adapted linears. Call it before wrapping the model in megatron's DDP.
    Raises ``LoRAConfigError`` when a target matches nothing on this stage or a target's module is not the
    linear its style adapts, ``TypeError`` if LoRA is on, and ``ValueError`` for an unknown ``expert_lora_kernel``
    or ``"triton"`` without Triton.
    """
    if not isinstance(lora, LoRAConfig):
        raise TypeError(f"apply_megatron_lora: lora is a {type(lora).__name__}, expected LoRAConfig")
    if any(isinstance(m, LoRAAdapter) for m in model.modules()):
        raise TypeError("apply_megatron_lora: the model already carries LoRA adapters")
    expert_lora.check_kernel_choice(expert_lora_kernel, flag="expert_lora_kernel")
    sites = []
    for layer in _layers(model):
        cfg = layer.config.k3
        for target in lora.targets:
            for block in target.placement.blocks_at(cfg, layer.layer_idx):
                name = target.megatron_module(block)
                linear = layer.get_submodule(name)
                if not isinstance(linear, BASE_CLASSES[target.style]):
                    raise LoRAConfigError(f"LoRA target {target.name!r}: decoder.layers.{layer.layer_idx}.{name} is "
                                          f"a {type(linear).__name__}, expected a "
                                          f"{BASE_CLASSES[target.style].__name__} ({target.style.value})")
                sites.append((layer, target, name, linear))
    for p in model.parameters():
        p.requires_grad_(False)
    adapted: list[str] = []
    hits = {t: 0 for t in lora.target_modules}
    contexts: dict[int, ParallelContext] = {}  # one per layer, shared by its adapters
    for layer, target, name, linear in sites:
        global_name = f"decoder.layers.{layer.layer_idx}.{name}"
        if id(layer) not in contexts:
            contexts[id(layer)] = ParallelContext(layer.pg_collection, layer.config.sequence_parallel)
        linear.lora = _new_adapter(target, linear, layer.config.k3.num_experts, expert_lora_kernel, lora=lora,
                                   ctx=contexts[id(layer)], global_name=global_name, seed=seed)
        adapted.append(global_name)
        hits[target.name] += 1
    missing = sorted(t for t, n in hits.items() if n == 0)
    whole_model = len(_layers(model)) == getattr(model.config, "num_layers", -1)
    if missing and whole_model:  # a pipeline stage may legitimately hold no layer of a target's kind
        raise LoRAConfigError(f"LoRA targets {missing} match no module on this pipeline stage")
    model.lora_config = lora
    return adapted


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every adapter factor, in model order."""
    return [(n, p) for n, p in model.named_parameters() if hasattr(p, "k3_lora_factor")]



def _adapters(model: nn.Module):
    """``(global adapter-parameter name, parameter, adapter)`` for every factor on this stage."""
    for layer in _layers(model):
        for module_name, module in layer.named_modules():
            if isinstance(module, LoRAAdapter):
                for factor, p in module.named_parameters(recurse=False):
                    yield f"decoder.layers.{layer.layer_idx}.{module_name}.{factor}", p, module


def lora_factors(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(global name, global shape)`` of every adapter factor on this stage, in model order. Local: no
    communication (a split factor's global shape is its piece's with the split dim times the group size)."""
    out = []
    for name, p, adapter in _adapters(model):
        rule = factor_rule(p.k3_lora_factor)
        shape = list(p.shape)
        if rule.split_group is not None:
            shape[rule.split_dim] *= adapter.ctx.layout.size(rule.split_group)
        out.append((name, tuple(shape)))
    return out


def iter_lora(model: nn.Module, names: Iterable[str] | None = None,
              grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global name, global tensor)`` of this stage's adapter factors one at a time, in model order: all of
    them, or those in ``names`` (a name not on this stage raises ``KeyError`` before anything is gathered).
    Collective over TP/EP: every rank of the stage iterates the same names to the end.

    A split factor is gathered over its TP/EP group into a fresh tensor; a factor this rank holds whole is its
    parameter's (or gradient's) own data, detached, not a copy: copy it before keeping or changing it. Nothing
    but the factor being yielded stays referenced, so a caller that drops each before the next holds at most
    one global factor (``grads=True``: the gradients, ``main_grad`` under megatron's DDP)."""
    import torch.distributed as dist

    wanted = None if names is None else set(names)
    found = []
    for name, p, adapter in _adapters(model):
        if wanted is None or name in wanted:
            found.append((name, p, adapter))
    if wanted is not None and len(found) != len(wanted):
        missing = sorted(wanted - {name for name, _, _ in found})
        raise KeyError(f"iter_lora: {len(missing)} factors are not on this stage, e.g. {missing[:3]}")
    for name, p, adapter in found:
        t = p
        if grads:
            t = getattr(p, "main_grad", None)
            t = p.grad if t is None else t
            if t is None:
                raise RuntimeError(f"gather_lora: {name} has no gradient yet")
        t = t.detach()
        rule = factor_rule(p.k3_lora_factor)
        if rule.split_group is not None and adapter.ctx.layout.size(rule.split_group) > 1:
            group = adapter.ctx.tp_group if rule.split_group == "tp" else adapter.ctx.ep_group
            pieces = [torch.empty_like(t) for _ in range(group.size())]
            dist.all_gather(pieces, t.contiguous(), group=group)
            t = gather(pieces, p.k3_lora_factor)
            del pieces  # the generator is suspended at the yield: hold the global tensor only
        yield name, t
        del t


def gather_lora(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter factor of this stage as its *global* tensor (gathered over TP/EP; collective: every rank
    of the stage calls it), each a fresh copy. ``grads=True`` gathers the gradients (``main_grad`` under
    megatron's DDP) instead."""
    return {name: t.clone() for name, t in iter_lora(model, grads=grads)}


@torch.no_grad()
def load_lora(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set every adapter factor of this stage from its global tensor in ``state`` (names as ``gather_lora``'s;
    tensors of other stages are ignored, a missing one raises ``KeyError``)."""
    names = {name for name, _, _ in _adapters(model)}
    missing = sorted(names - set(state))
    if missing:
        raise KeyError(f"load_lora: no tensor for {len(missing)} factors, e.g. {missing[:3]}")
    for name, p, adapter in _adapters(model):
        rule = factor_rule(p.k3_lora_factor)
        piece = shard(state[name], p.k3_lora_factor, adapter.ctx.layout, adapter.ctx.rank_in(rule.split_group))
        if piece.shape != p.shape:
            raise ValueError(f"load_lora: {name} is {tuple(state[name].shape)} globally, which gives a piece of "
                             f"{tuple(piece.shape)}; the adapter holds {tuple(p.shape)}")
        p.copy_(piece)
