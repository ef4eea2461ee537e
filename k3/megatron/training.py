"""A megatron training step for K3 with LoRA: DDP, megatron's optimizer, its forward-backward schedule.

``build_lora_trainer`` builds this rank's model (``k3_model_provider``), loads the base weights, attaches the
adapters, wraps the model in megatron's ``DistributedDataParallel`` and builds megatron's optimizer over the
adapter factors; ``MegatronLoRATrainer.step`` runs one optimizer step over a list of micro-batches (gradient
accumulation; the loss is the token-mean of each micro-batch, averaged over micro-batches and data-parallel
ranks, megatron's convention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from k3.lora.config import LoRAConfig
from k3.megatron.config import K3TransformerConfig
from k3.megatron.grads import finalize_k3_model_grads
from k3.megatron.lora import apply_megatron_lora
from k3.megatron.model import k3_model_provider

__all__ = ["MicroBatch", "MegatronLoRATrainer", "build_lora_trainer"]


@dataclass
class MicroBatch:
    """One micro-batch: ``input_ids``/``labels`` ``[batch, seq]`` long, ``loss_mask`` ``[batch, seq]`` float (1
    where the token's loss counts; pad on the right)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


def _masked_mean(loss_mask: torch.Tensor, per_token: torch.Tensor):
    mask = loss_mask.float()
    loss = (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"loss": loss.detach().clone()}


@dataclass
class MegatronLoRATrainer:
    """``model``: the DDP-wrapped stage (a one-element list, megatron's model chunks); ``optimizer``: megatron's."""

    config: K3TransformerConfig
    model: list[DistributedDataParallel]
    optimizer: object

    def step(self, micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; returns ``loss`` (mean over micro-batches and DP ranks),
        ``grad_norm`` and whether the update was applied."""
        if not micro_batches:
            raise ValueError("step: no micro-batches")
        shapes = {tuple(mb.input_ids.shape) for mb in micro_batches}
        if len(shapes) != 1:
            raise ValueError(f"step: micro-batches have different shapes {sorted(shapes)}; pad them to one")
        b, s = shapes.pop()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        data = iter(micro_batches)
        device = next(self.model[0].parameters()).device

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(mb.input_ids.to(device), None, None, labels=mb.labels.to(device))
            return out, partial(_masked_mean, mb.loss_mask.to(device))

        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=self.model,
            num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b, forward_only=False,
        )
        applied, grad_norm, _ = self.optimizer.step()
        loss = torch.zeros((), device=device)
        if parallel_state.is_pipeline_last_stage() and losses:
            loss = torch.stack([d["loss"] for d in losses]).mean()
        dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())  # from the last stage
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss / parallel_state.get_data_parallel_world_size()
        return {"loss": float(loss), "grad_norm": float(grad_norm or 0.0), "applied": bool(applied)}


def build_lora_trainer(
    config: K3TransformerConfig,
    lora: LoRAConfig,
    load_base: Callable[[torch.nn.Module], object],
    lr: float = 1e-5,
    clip_grad: float = 1.0,
    weight_decay: float = 0.0,
    use_distributed_optimizer: bool = False,
    lora_seed: int = 0,
) -> MegatronLoRATrainer:
    """This rank's trainer: model from ``config``, base weights via ``load_base(model)`` (e.g.
    ``partial(load_dist, load=DCP)`` or ``partial(load_hf_checkpoint, hf_dir=…, cfg=…)``), adapters from
    ``lora``, Adam over the adapters. Call after ``k3.megatron.parallel.init_parallel``."""
    model = k3_model_provider(config)
    if torch.cuda.is_available():
        model = model.cuda()
    load_base(model)
    apply_megatron_lora(model, lora, seed=lora_seed)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                                 bf16=config.bf16, params_dtype=config.params_dtype,
                                 use_distributed_optimizer=use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.finalize_model_grads_func = finalize_k3_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    return MegatronLoRATrainer(config=config, model=[ddp], optimizer=optimizer)
