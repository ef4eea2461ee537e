"""A megatron training step for K3 with LoRA: DDP, megatron's optimizer, its forward-backward schedule.

``build_lora_trainer`` builds this rank's model (``k3_model_provider``), loads the base weights, attaches the
adapters, wraps the model in megatron's ``DistributedDataParallel`` and builds megatron's optimizer over the
adapter factors. ``MegatronLoRATrainer``:

- ``step(micro_batches, loss_fn)`` runs one optimizer step over this rank's micro-batches (gradient
  accumulation) with a pluggable loss. The forward yields per-token log-probabilities of the labels
  (``TokenOutputs``, megatron's vocab-parallel cross entropy, negated) and, on request, per-token entropies;
  ``loss_fn`` turns them into the micro-batch's *share* of the step's loss. The step minimises the sum of the
  shares over micro-batches and data-parallel ranks. The default, ``token_mean_loss``, is megatron's
  convention: the token-mean of each micro-batch, averaged over micro-batches and data-parallel ranks.
- ``forward(micro_batches)`` is the same forward without gradients (log-probs of rollout tokens).

Both take the per-token log-probs (and entropies) from the logits in chunks of ``log_probs_chunk_size`` tokens
(``token_outputs``; the recipe's ``--log-probs-chunk-size``): the float32 copy and megatron's cross-entropy
temporaries ``[tokens, vocab/TP]`` exist for one chunk at a time. In a training step each chunk runs under
activation checkpointing, so what autograd keeps is the logits, not each chunk's float32 softmax, and the backward
recomputes one chunk at a time. -1: one pass over all tokens. ``check_for_nan``: the step runs a
``k3.megatron.nan_guard.NanGuard``.

A micro-batch is either padded rows ``[batch, seq]`` (every micro-batch of a call the same shape) or packed
sequences: one row ``[1, T]`` holding whole sequences back to back with their bounds ``cu_seqlens``, handed to the
model as megatron's THD ``packed_seq_params`` (``k3.megatron.packed``); packed micro-batches of a call may differ
in length (megatron's schedule exchanges shapes between pipeline stages: ``variable_seq_lengths``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.utils.checkpoint import checkpoint

from k3.megatron import optimizer as megatron_optimizer
from k3.megatron.config import K3TransformerConfig
from k3.megatron.context_parallel import cp_gather_tokens, cp_local_tokens
from k3.megatron.ddp_regions import Region, build_ddp_in_regions
from k3.megatron.grads import finalize_k3_model_grads
from k3.megatron.lora import apply_megatron_lora
from k3.megatron.model import k3_model_provider
from k3.megatron.nan_guard import NanGuard
from k3.megatron.packed import check_bounds, packed_seq_params
from k3.settings.lora import LoRAConfig
from k3.settings.train import NO_LOG_PROBS_CHUNKING, check_log_probs_chunk_size

__all__ = ["LossContext", "LossFn", "MegatronLoRATrainer", "MicroBatch", "TokenOutputs", "build_lora_trainer",
           "token_mean_loss", "token_outputs", "vocab_parallel_entropy"]


@dataclass
class MicroBatch:
    """One micro-batch: ``input_ids``/``labels`` ``[batch, seq]`` long, ``loss_mask`` ``[batch, seq]`` float (1
    where the token's loss counts; pad on the right). ``extra``: whatever else a loss function reads (e.g.
    old log-probs ``[batch, seq]``, advantages ``[batch]``); moved to the model's device with the rest.

    ``cu_seqlens``: packed sequences — the tensors are one row ``[1, T]`` and sequence ``n`` is tokens
    ``cu_seqlens[n]:cu_seqlens[n+1]`` (host int64 ``[N + 1]``, whole sequences, ending at ``T``); None: padded
    rows. Under context parallelism every packed sequence is a multiple of ``2·CP`` tokens long."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    cu_seqlens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.cu_seqlens is not None:
            if self.input_ids.dim() != 2 or self.input_ids.shape[0] != 1:
                raise ValueError(f"MicroBatch: packed sequences (cu_seqlens) come as one row [1, T], got input_ids "
                                 f"{tuple(self.input_ids.shape)}")
            self.cu_seqlens = check_bounds(self.cu_seqlens, self.input_ids.shape[1], "MicroBatch.cu_seqlens")

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(self.input_ids.to(device), self.labels.to(device), self.loss_mask.to(device),
                          {k: v.to(device) for k, v in self.extra.items()}, self.cu_seqlens)


@dataclass
class TokenOutputs:
    """What the forward yields per token: ``log_probs`` ``[batch, seq]`` float32, log p(label) in nats (carries
    the graph in a training step); ``entropy`` ``[batch, seq]`` float32 of the next-token distribution, detached,
    or None when not asked for."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None


@dataclass(frozen=True)
class LossContext:
    """Where a micro-batch sits: micro-batches per rank in this step, data- and context-parallel sizes."""

    num_micro_batches: int
    data_parallel_size: int
    context_parallel_size: int = 1


LossFn = Callable[[MicroBatch, TokenOutputs, LossContext], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(mb, outputs, ctx) -> (share, metrics)``: ``share`` is the micro-batch's contribution to the
step's loss (a scalar with the graph): the loss minimised is the sum of the shares over micro-batches and
data-/context-parallel ranks. ``metrics``: detached scalars, summed the same way."""


def token_mean_loss(mb: MicroBatch, out: TokenOutputs, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Megatron's convention: the masked token-mean of ``-log p`` of each micro-batch, averaged over the
    micro-batches and data-parallel ranks. Under context parallelism a rank holds part of each sequence: its
    share divides its token sum by the micro-batch's token count over the CP group, so the CP ranks' shares add
    up to the micro-batch's mean."""
    mask = mb.loss_mask.float()
    count = mask.sum()
    if ctx.context_parallel_size > 1:
        count = count.detach().clone()
        dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
    mean = (-out.log_probs * mask).sum() / count.clamp_min(1.0)
    return mean / (ctx.num_micro_batches * ctx.data_parallel_size), {}


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats, float32) of the softmax over the whole vocabulary, from this TP rank's vocab slice
    ``logits [..., vocab/tp]``: ``log Z - sum(p · (l - max))`` with the max, ``Z`` and the sum reduced over TP."""
    group = parallel_state.get_tensor_model_parallel_group()
    many = dist.get_world_size(group) > 1
    x = logits.float()
    peak = x.max(dim=-1).values
    if many:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = x - peak.unsqueeze(-1)
    e = shifted.exp()
    sums = torch.stack([e.sum(dim=-1), (e * shifted).sum(dim=-1)])
    if many:
        dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]


def _chunk_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # A fresh float32 copy: megatron's cross entropy works in place, and a checkpointed chunk's input must be intact
    # when the backward recomputes it.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), labels)


def token_outputs(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool = False,
                  chunk_size: int = NO_LOG_PROBS_CHUNKING) -> TokenOutputs:
    """Per-token log-probs (and entropies) from this TP rank's ``logits [batch, seq, vocab/tp]`` and ``labels
    [batch, seq]``.

    ``chunk_size``: tokens (over ``batch × seq`` in order) per chunk of the vocab-parallel log-softmax; each chunk's
    float32 temporaries ``[chunk, vocab/tp]`` are freed before the next, and with gradients each chunk is
    checkpointed (recomputed, one at a time, in the backward). :data:`NO_LOG_PROBS_CHUNKING` (-1): all tokens at
    once, megatron's cross entropy in place on the float32 logits (the entropy is taken first for that reason).
    The values are the same either way: each token's log-softmax reads only its own row."""
    check_log_probs_chunk_size(chunk_size)
    if chunk_size == NO_LOG_PROBS_CHUNKING:
        entropy = vocab_parallel_entropy(logits) if with_entropy else None
        log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)
        return TokenOutputs(log_probs=log_probs, entropy=entropy)
    vocab = logits.shape[-1]
    flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1)
    grad = torch.is_grad_enabled() and flat.requires_grad
    log_probs, entropy = [], []
    for piece, piece_labels in zip(flat.split(chunk_size), flat_labels.split(chunk_size)):
        if with_entropy:
            entropy.append(vocab_parallel_entropy(piece))
        if grad:
            log_probs.append(checkpoint(_chunk_log_probs, piece, piece_labels, use_reentrant=False,
                                        preserve_rng_state=False))  # deterministic: no random state to replay
        else:
            log_probs.append(_chunk_log_probs(piece, piece_labels))
    return TokenOutputs(log_probs=torch.cat(log_probs).reshape(labels.shape),
                        entropy=torch.cat(entropy).reshape(labels.shape) if with_entropy else None)


def _cp_local(mb: MicroBatch) -> MicroBatch:
    """This context-parallel rank's tokens of ``mb`` (the load-balanced split of ``k3.megatron.context_parallel``,
    per sequence when packed): the ids, labels, mask and every ``extra`` tensor shaped ``[batch, seq]`` like them;
    per-sequence extras (e.g. advantages ``[batch]``) stay whole, and so do the packed bounds (the layers take
    the whole sequences'). The whole ``mb`` at CP 1."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return mb
    group, shape = parallel_state.get_context_parallel_group(), mb.input_ids.shape

    def cut(t: torch.Tensor) -> torch.Tensor:
        return cp_local_tokens(t, group, cu_seqlens=mb.cu_seqlens) if t.shape[:2] == shape else t

    local = [cut(mb.input_ids), cut(mb.labels), cut(mb.loss_mask), {k: cut(v) for k, v in mb.extra.items()}]
    out = MicroBatch(*local)
    out.cu_seqlens = mb.cu_seqlens  # the whole sequences' bounds (set after the row-length check of the init)
    return out


def _check_shapes(micro_batches: Sequence[MicroBatch], what: str) -> tuple[int, int]:
    """``(rows, seq)`` for megatron's schedule: the one shape of padded micro-batches, or ``(1, longest T)`` of
    packed ones (their lengths may differ)."""
    if not micro_batches:
        raise ValueError(f"{what}: no micro-batches")
    packed = {mb.cu_seqlens is not None for mb in micro_batches}
    if len(packed) != 1:
        raise ValueError(f"{what}: some micro-batches are packed (cu_seqlens) and some padded; use one form per call")
    if packed.pop():
        return 1, max(mb.input_ids.shape[1] for mb in micro_batches)
    shapes = {tuple(mb.input_ids.shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"{what}: micro-batches have different shapes {sorted(shapes)}; pad them to one")
    return shapes.pop()


@dataclass
class MegatronLoRATrainer:
    """``model``: the DDP-wrapped stage (a one-element list, megatron's model chunks); ``optimizer``: megatron's;
    ``log_probs_chunk_size``: as ``token_outputs``' ``chunk_size``; ``check_for_nan``: every step runs a
    ``NanGuard`` (``k3.megatron.nan_guard``)."""

    config: K3TransformerConfig
    model: list[DistributedDataParallel]
    optimizer: object
    log_probs_chunk_size: int = NO_LOG_PROBS_CHUNKING
    check_for_nan: bool = False
    _guard: NanGuard | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_log_probs_chunk_size(self.log_probs_chunk_size)
        # The guard sees each rank's gradients before any reduction: first thing in the finalize hook. Without the
        # check, the hook is K3's finalize itself.
        self.config.finalize_model_grads_func = self._finalize_grads if self.check_for_nan else finalize_k3_model_grads

    def _finalize_grads(self, model, *args, **kwargs) -> None:
        if self._guard is not None:
            self._guard.note_grads(model)
        finalize_k3_model_grads(model, *args, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model[0].parameters()).device

    def context(self, num_micro_batches: int) -> LossContext:
        return LossContext(num_micro_batches, parallel_state.get_data_parallel_world_size(),
                           parallel_state.get_context_parallel_world_size())

    def _run(self, micro_batches: Sequence[MicroBatch], loss_func, forward_only: bool, b: int, s: int) -> list:
        device = self.device
        data = iter([_cp_local(mb.to(device)) for mb in micro_batches])

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            packed = None if mb.cu_seqlens is None else packed_seq_params(mb.cu_seqlens, device)
            logits = model(mb.input_ids, None, None, packed_seq_params=packed)  # [b, s, vocab/tp] on the last stage
            return logits, partial(loss_func, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=self.model,
            num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b, forward_only=forward_only,
        )

    def step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn = token_mean_loss,
             with_entropy: bool = False, step_index: int | None = None) -> dict[str, float]:
        """One optimizer step over this rank's ``micro_batches`` minimising the sum of ``loss_fn``'s shares.

        Returns ``loss`` (the sum of the shares over micro-batches and data-parallel ranks), every metric of
        ``loss_fn`` summed the same way, ``grad_norm`` (before clipping) and ``applied``. With ``check_for_nan``, a
        NaN or Inf in a loss share or in a rank's gradients applies nothing and raises
        ``k3.megatron.nan_guard.NonFiniteError`` on every rank, naming the ranks and ``step_index`` (the optimizer
        step, for the message). Either way a non-finite global gradient norm applies nothing and raises
        ``FloatingPointError``."""
        b, s = _check_shapes(micro_batches, "step")
        ctx = self.context(len(micro_batches))
        # megatron's schedule divides each returned loss by the micro-batch count and DDP averages gradients
        # over data-parallel ranks (the context-parallel factor cancels): undo both, so the gradient is that of
        # the sum of the shares.
        undo = float(ctx.num_micro_batches * ctx.data_parallel_size)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.model[0].train()

        guard = None
        if self.check_for_nan:  # parameters named as in the model (under DDP's ``module.``)
            guard = NanGuard(step_index, {p: n for chunk in self.model for n, p in chunk.module.named_parameters()})

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            share, metrics = loss_fn(mb, token_outputs(logits, mb.labels, with_entropy, self.log_probs_chunk_size),
                                     ctx)
            if guard is not None:
                guard.note_loss(share)
            # clone: the schedule divides the returned loss in place
            reported = {"loss": share.detach().clone(), **{k: v.detach().clone() for k, v in metrics.items()}}
            return share * undo, reported

        self._guard = guard
        try:
            stored = self._run(micro_batches, loss_func, False, b, s)
        finally:
            self._guard = None
        if guard is not None:
            try:
                guard.raise_if_any(self.device)
            except FloatingPointError:
                self._discard_grads()
                raise
        sums = self._reduce_metrics(stored)
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            self._discard_grads()
            at = "" if step_index is None else f" at optimizer step {step_index}"
            raise FloatingPointError(f"gradient norm is {norm}{at}: the optimizer step was not applied")
        applied, _, _ = self.optimizer.step()
        return {**sums, "grad_norm": norm, "applied": bool(applied)}

    def _discard_grads(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _reduce_metrics(self, stored: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Sum the per-micro-batch metric dicts of the last stage over micro-batches, then over the pipeline
        (from the last stage) and the data-/context-parallel ranks."""
        names = sorted(stored[0]) if stored else []
        # every stage must agree on the names: they come from the last stage
        holder = [names]
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        if dist.get_world_size(pp_group) > 1:
            dist.broadcast_object_list(holder, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=pp_group)
        names = holder[0]
        device = self.device
        total = torch.zeros(len(names), dtype=torch.float64, device=device)
        if parallel_state.is_pipeline_last_stage() and stored:
            total = torch.stack([torch.stack([d[n].double() for n in names]) for d in stored]).sum(0).to(device)
        dist.all_reduce(total, group=pp_group)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return {n: float(v) for n, v in zip(names, total.tolist())}

    @torch.no_grad()
    def forward(self, micro_batches: Sequence[MicroBatch], with_entropy: bool = False) -> list[TokenOutputs]:
        """Per-token log-probs (and entropies) of every micro-batch, in eval mode and without gradients; every
        pipeline stage gets them (broadcast from the last)."""
        b, s = _check_shapes(micro_batches, "forward")
        was_training = self.model[0].training
        self.model[0].eval()

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            out = token_outputs(logits, mb.labels, with_entropy, self.log_probs_chunk_size)
            kept = {"log_probs": out.log_probs.detach()}
            if out.entropy is not None:
                kept["entropy"] = out.entropy
            return torch.zeros((), device=logits.device), kept

        try:
            stored = self._run(micro_batches, loss_func, True, b, s)
        finally:
            self.model[0].train(was_training)
        device = self.device
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        last = parallel_state.is_pipeline_last_stage()
        outs = []
        for k, mb in enumerate(micro_batches):
            shape = tuple(mb.input_ids.shape)
            lp = stored[k]["log_probs"] if last else torch.empty(shape, dtype=torch.float32, device=device)
            ent = stored[k].get("entropy") if last else (
                torch.empty(shape, dtype=torch.float32, device=device) if with_entropy else None)
            if last:  # under CP each rank holds its tokens: back into sequence order
                cp_group = parallel_state.get_context_parallel_group()
                lp = cp_gather_tokens(lp, cp_group, cu_seqlens=mb.cu_seqlens)
                ent = None if ent is None else cp_gather_tokens(ent, cp_group, cu_seqlens=mb.cu_seqlens)
            if dist.get_world_size(pp_group) > 1:
                src = parallel_state.get_pipeline_model_parallel_last_rank()
                dist.broadcast(lp, src=src, group=pp_group)
                if ent is not None:
                    dist.broadcast(ent, src=src, group=pp_group)
            outs.append(TokenOutputs(log_probs=lp, entropy=ent))
        return outs


def build_lora_trainer(
    config: K3TransformerConfig,
    lora: LoRAConfig,
    load_base: Callable[[torch.nn.Module], object],
    lr: float = 1e-5,
    clip_grad: float = 1.0,
    weight_decay: float = 0.0,
    use_distributed_optimizer: bool = False,
    lora_seed: int = 0,
    betas: tuple[float, float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
    expert_lora_kernel: str = "torch",
    optimizer_cpu_offload: bool = False,
    optimizer_offload_fraction: float = 0.0,
    log_probs_chunk_size: int = NO_LOG_PROBS_CHUNKING,
    check_for_nan: bool = False,
    param_region: Region | None = None,
    grad_region: Region | None = None,
    optimizer: str = "adam",
    sgd_momentum: float = 0.0,
) -> MegatronLoRATrainer:
    """This rank's trainer: model from ``config``, base weights via ``load_base(model)`` (e.g.
    ``partial(load_dist, load=DCP)`` or ``partial(load_hf_checkpoint, hf_dir=…, cfg=…)``), adapters from
    ``lora``, megatron's ``optimizer`` over the adapters (``k3.megatron.optimizer.build_megatron_optimizer``: Adam
    with ``betas`` / ``adam_eps``, or SGD with ``sgd_momentum``; plain or ``use_distributed_optimizer``,
    ``optimizer_cpu_offload`` of ``optimizer_offload_fraction``; refused before the model is built when
    megatron-core cannot run them); ``expert_lora_kernel`` as ``apply_megatron_lora``'s;
    ``log_probs_chunk_size`` and ``check_for_nan`` as ``MegatronLoRATrainer``'s. ``param_region`` /
    ``grad_region``: where the parameters and DDP's gradient buffers are allocated (the trainer's memory regions,
    ``k3.megatron.ddp_regions``; None: the ordinary allocator); the optimizer is built outside both. Call after
    ``k3.megatron.parallel.init_parallel``."""
    # Refusals first, before the model is built (looked up at call time: a CPU test stands in the device check).
    megatron_optimizer.check_optimizer_options(use_distributed_optimizer, optimizer_cpu_offload,
                                               optimizer_offload_fraction, optimizer, sgd_momentum)
    if optimizer_cpu_offload:
        megatron_optimizer.require_offload_device()
    check_log_probs_chunk_size(log_probs_chunk_size)
    with (param_region or nullcontext)():
        model = k3_model_provider(config)
        if torch.cuda.is_available():
            model = model.cuda()
        load_base(model)
        apply_megatron_lora(model, lora, seed=lora_seed, expert_lora_kernel=expert_lora_kernel)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    ddp = build_ddp_in_regions(lambda: DistributedDataParallel(config=config, ddp_config=ddp_config, module=model),
                               param_region, grad_region)
    built = megatron_optimizer.build_megatron_optimizer(
        [ddp], lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, betas=betas, adam_eps=adam_eps, bf16=config.bf16,
        params_dtype=config.params_dtype, distributed=use_distributed_optimizer, cpu_offload=optimizer_cpu_offload,
        offload_fraction=optimizer_offload_fraction, optimizer=optimizer, sgd_momentum=sgd_momentum)
    # Megatron's lr scheduler is what turns a group's wd_mult / lr_mult into its settings; there is none here
    # (constant lr, the recipe's), so apply them once.
    for group in built.param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        group["lr"] = lr * group.get("lr_mult", 1.0)
    config.grad_scale_func = built.scale_loss
    config.no_sync_func = ddp.no_sync
    # the trainer sets config.finalize_model_grads_func (K3's finalize, behind the NaN guard when it is on)
    return MegatronLoRATrainer(config=config, model=[ddp], optimizer=built,
                               log_probs_chunk_size=log_probs_chunk_size, check_for_nan=check_for_nan)
