"""The trainer's side of GRPO on the megatron backend, with the interface of ``k3.rl.trainers.torch.PolicyTrainer``.

``MegatronPolicy`` holds this rank's ``MegatronLoRATrainer`` (``k3.megatron.training``) and gives the loop what
the torch ``PolicyTrainer`` gives it:

- ``log_probs(trajs)``: per-token log-probs of each response (the forward of ``MegatronLoRATrainer.forward``);
- ``train_step(trajs)``: one optimizer step on a global batch with the GRPO loss of ``k3.rl.grpo.policy_loss``
  (asymmetric PPO-clip on the old log-probs and per-sample advantages), token-mean over every response token
  of the global batch: each micro-batch's share is its token sum divided by the global count, so the sum of the
  shares over micro-batches and data-parallel ranks is that mean;
- ``export_chunks(version)``: the adapters in the exact HF/PEFT-named chunk layout of
  ``k3.lora.export.chunk_layout`` (names via ``k3.checkpoint.names``), BF16, so the engine's ``AdapterReceiver``
  accepts them; ``save_adapter``/``load_adapter`` in PEFT files (the torch backend's files: either backend reads
  the other's); ``optimizer_state``/``load_optimizer_state``.

Batches: a trajectory is ``prompt_ids + response_ids``; response token ``j`` is predicted at position
``len(prompt) + j - 1``. Every micro-batch of a call has one shape ``[rows, seq]`` (megatron's schedule and
expert all-to-all need the same micro-batch count and shape on every rank): ``seq`` is the longest trajectory
minus one, rounded up to a multiple of TP (sequence parallelism splits it), times 2·CP under context
parallelism (the trainer hands each CP rank two of 2·CP chunks of every sequence); ``rows`` fits
``max_tokens_per_micro_batch``; rows past the end are padding with an empty loss mask. Data-parallel rank ``d``
takes trajectories ``d, d + DP, …`` of the global batch.

Dynamic batch size (``dynamic_batch``, the recipe's ``--use-dynamic-batch-size``): instead of padded rows, each
micro-batch packs whole trajectories back to back (megatron's THD format, ``k3.megatron.packed``), planned by
``k3.megatron.packing.plan_micro_batches`` from the trajectories' lengths and ``max_tokens_per_micro_batch`` (the
recipe's ``max_tokens_per_gpu``): balanced over data-parallel ranks, the first-fit micro-batch count, balanced
micro-batches. The loss is then the recipe's: each response's token mean, averaged over the global batch
(``sample_mean_weights``); the padded path keeps the token mean over every response token of the global batch.
Under context parallelism each packed trajectory is padded after its last token to a multiple of ``2·CP`` tokens
(at least ``2·CP·(conv kernel − 1)``, the KDA halo); the packed row ends with a padding segment so its length
splits over CP and TP.

Activation recompute (``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``) is megatron's
(``k3.megatron.recompute``); it changes the memory held, never the numbers.

The optimizer is ``grpo.optimizer``'s: Adam (normal mode) or SGD (debug_minimal), plain or distributed, each with
its own optimizer state (tagged, so a resume with the other is refused). The run's guards and memory settings,
applied by ``k3.megatron``: ``use_distributed_optimizer`` /
``optimizer_cpu_offload`` / ``optimizer_offload_fraction`` (``k3.megatron.optimizer``; the optimizer state of a
checkpoint then holds each rank's slice, and says which optimizer wrote it), ``check_for_nan_in_loss_and_grad``
(``k3.megatron.nan_guard``: the error names the ranks and the optimizer step), ``distributed_timeout_minutes``
(every process group, ``k3.megatron.parallel``) and ``log_probs_chunk_size`` (the log-softmax in chunks of that
many tokens, ``k3.megatron.training.token_outputs``).

Layout: the run's ``ParallelLayout`` (TP, EP, PP, CP and the pipeline split; ``parallel`` = (TP, EP, PP, CP) in
the optimizer state); the policy runs under TP, EP (with
DP) and CP (tests/parity/test_megatron_policy.py: equal to one rank); the loop runs one policy per training
rank, each in its own Ray actor (``k3.rl.trainers.group``), every rank given the same trajectories. Under PP
the adapter export streams: each chunk is made by the stage holding its layer and broadcast over the PP group,
so every rank yields the whole stream while holding about one chunk (tests/parity/test_megatron_pp_export.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from safetensors import safe_open

from k3.checkpoint.hf_io import CheckpointError
from k3.checkpoint.names import NameMapError, hf_lora_to_megatron, megatron_lora_to_hf
from k3.config import K3Config
from k3.settings.lora import LoRAConfig, LoRAConfigError
from k3.settings.parallel import ParallelLayout
from k3.lora.export import (AdapterChunk, ChunkAllocator, ChunkSpec, ExportError, PEFT_PREFIX, chunk_layout,
                            read_peft_adapter_config, write_peft_adapter)
from k3.rl.grpo import GRPOConfig, policy_loss
from k3.rl.trainers.memory_regions import GRAD_BUFFER_TAG, GradBuffers, Regions
from k3.rl.trainers.trajectory import Trajectory
from k3.transport.device_memory import memory_note
from k3.transport.handoff import flat_views, resolved_device

__all__ = ["BACKEND", "DDPGradBuffers", "MegatronPolicy", "build_megatron_policy"]

BACKEND = "megatron"  # tag of the optimizer state: a torch-backend state cannot be loaded here, and back


def build_megatron_policy(
    model_dir: str | Path,
    lora: LoRAConfig,
    pad_id: int,
    grpo: GRPOConfig | None = None,
    max_tokens_per_micro_batch: int = 8192,
    *,
    layout: ParallelLayout | None = None,
    ref_load: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    expert_lora_kernel: str = "torch",
    use_dynamic_batch_size: bool = False,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    use_distributed_optimizer: bool = False,
    optimizer_cpu_offload: bool = False,
    optimizer_offload_fraction: float = 0.0,
    check_for_nan_in_loss_and_grad: bool = False,
    distributed_timeout_minutes: float = 10,
    log_probs_chunk_size: int = -1,
    regions: Regions | None = None,
) -> MegatronPolicy:
    """Join the process group, create megatron's TP/EP/PP/CP groups for ``layout`` (its model-parallel sizes and
    pipeline split; None: one rank of everything, ``ParallelLayout.model_parallel()``) and build
    this rank's policy: the K3 config of the BF16 HF checkpoint ``model_dir`` (the engine's), base weights from
    the torch_dist checkpoint ``ref_load`` when given (``load_dist``, any source layout) or else from
    ``model_dir`` (``load_hf_checkpoint``), adapters seeded by ``seed``, megatron's optimizer of ``grpo``
    (``grpo.optimizer``: Adam or SGD, with its settings; default ``GRPOConfig()``, the recipe's normal mode).
    ``expert_lora_kernel``: ``torch`` or ``triton``, how the routed-expert adapters run (``apply_megatron_lora``).
    On CUDA the model goes to the current device (``init_parallel`` sets it from ``LOCAL_RANK``).
    ``use_dynamic_batch_size``: packed micro-batches and the recipe's loss (module docstring); ``recompute_*``:
    megatron's activation recompute
    (``k3.megatron.recompute.Recompute``; checked here, before any process group is joined). The guards and memory
    settings (module docstring) are checked here too, the device last (the CPU offload needs CUDA). ``regions``: the trainer's memory regions
    (``k3.rl.trainers.memory_regions``; the parameters and DDP's gradient buffers are built inside them), None
    without ``--offload-train``."""
    from k3.megatron import optimizer as megatron_optimizer
    from k3.megatron.checkpoint import load_dist, load_hf_checkpoint, read_dist_config
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.parallel import collective_timeout, init_parallel
    from k3.megatron.recompute import Recompute
    from k3.megatron.training import build_lora_trainer
    from k3.settings.train import check_log_probs_chunk_size

    recompute = Recompute(recompute_granularity, recompute_method, recompute_num_layers)
    grpo = GRPOConfig() if grpo is None else grpo
    megatron_optimizer.check_optimizer_options(use_distributed_optimizer, optimizer_cpu_offload,
                                               optimizer_offload_fraction, grpo.optimizer, grpo.sgd_momentum)
    check_log_probs_chunk_size(log_probs_chunk_size)
    collective_timeout(distributed_timeout_minutes)
    if optimizer_cpu_offload:
        megatron_optimizer.require_offload_device()

    engine_cfg = K3Config.from_json(model_dir)
    if engine_cfg.is_quantized and ref_load is None:
        # The recipe's pairing: the engine loads the native MXFP4 release, the trainer its torch_dist conversion.
        raise CheckpointError(f"{model_dir} is the native MXFP4 checkpoint: the Megatron trainer takes its frozen "
                              f"base from --ref-load (its torch_dist conversion: k3 convert mxfp4-to-bf16, then "
                              f"k3 convert hf-to-dist), or give the BF16 conversion as --hf-checkpoint")
    cfg = engine_cfg.replace(quantization_config=None)  # the trainer's base is BF16 whichever file the engine reads
    if ref_load is not None:
        stored = read_dist_config(ref_load)
        if stored.replace(quantization_config=None).to_hf_dict() != cfg.to_hf_dict():
            raise CheckpointError(f"--ref-load {ref_load} holds a different model than --hf-checkpoint "
                                  f"{model_dir} (their configs differ): convert the engine's checkpoint with "
                                  f"k3 convert hf-to-dist --hf-checkpoint {model_dir} --save DCP")
    layout = ParallelLayout.model_parallel() if layout is None else layout
    config = k3_transformer_config(cfg, layout, params_dtype=dtype, perform_initialization=False,
                                   recompute=recompute)  # validates
    init_parallel(layout, seed=seed, distributed_timeout_minutes=distributed_timeout_minutes)
    _say_device_memory("process groups made (NCCL communicators included)")

    def load_base(model: torch.nn.Module) -> None:
        if ref_load is not None:
            load_dist(model, ref_load)
        else:
            load_hf_checkpoint(model, model_dir, cfg)

    trainer = build_lora_trainer(config, lora, load_base, lr=grpo.lr, clip_grad=grpo.clip_grad,
                                 weight_decay=grpo.weight_decay, betas=grpo.betas, adam_eps=grpo.adam_eps,
                                 lora_seed=seed, expert_lora_kernel=expert_lora_kernel,
                                 use_distributed_optimizer=use_distributed_optimizer,
                                 optimizer_cpu_offload=optimizer_cpu_offload,
                                 optimizer_offload_fraction=optimizer_offload_fraction,
                                 log_probs_chunk_size=log_probs_chunk_size,
                                 check_for_nan=check_for_nan_in_loss_and_grad,
                                 param_region=None if regions is None else regions.params,
                                 grad_region=None if regions is None else regions.grad_buffers,
                                 optimizer=grpo.optimizer, sgd_momentum=grpo.sgd_momentum)
    _say_device_memory("model, adapters and optimizer built")
    return MegatronPolicy(trainer, cfg, lora, pad_id=pad_id, grpo=grpo,
                          max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                          parallel=(layout.tp, layout.ep, layout.pp, layout.cp), dynamic_batch=use_dynamic_batch_size)


def _say_device_memory(moment: str) -> None:
    # On a GPU shared with an engine, setup is where the budget is tightest, and a failed allocation inside
    # torch_memory_saver kills the process before any memory event reaches the run: these lines are what is left.
    if torch.cuda.is_available():
        print(f"trainer rank {dist.get_rank()}: {moment}; {memory_note('cuda')}", flush=True)


class DDPGradBuffers(GradBuffers):
    """Megatron DDP's gradient buffers (the dense and the expert-parallel ones of every model chunk) as the
    trainer's sleep sees them: under the memory saver they are its ``grad_buffer`` region (paused: discarded;
    resumed: zeroed); on CPU megatron's own ``offload_grad_buffers`` / ``restore_grad_buffers`` (storage resized to
    0 and back, zeroed; every view — bucket, ``main_grad`` — stays valid)."""

    def __init__(self, chunks: Sequence[Any]) -> None:
        self.chunks = list(chunks)

    def tensors(self) -> list[torch.Tensor]:
        return [b.grad_data for c in self.chunks for b in (*c.buffers, *c.expert_parallel_buffers)]

    def release(self, regions: Regions) -> None:
        if regions.captures:
            regions.pause(GRAD_BUFFER_TAG)
            return
        for chunk in self.chunks:
            chunk.offload_grad_buffers(synchronize=False, empty_cache=False)

    def restore(self, regions: Regions) -> None:
        if regions.captures:
            regions.resume(GRAD_BUFFER_TAG)
            for chunk in self.chunks:
                chunk.zero_grad_buffer()  # what the saver gives back is fresh, uninitialised memory
            return
        for chunk in self.chunks:
            chunk.restore_grad_buffers(synchronize=False)


@dataclass
class _ExportPlan:
    """``MegatronPolicy._export_plan``: the chunks, the PP-group rank making each, and per chunk this stage's
    megatron factors for it (empty where another stage makes it)."""

    layout: list[ChunkSpec]
    owner: list[int]
    sources: list[list[str]]
    pp_group: Any
    pp_rank: int


def _export_copy(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous ``dtype`` copy of an adapter tensor on ``device``: the one place the exporter makes a
    chunk tensor on the stage that holds it (tests count what it holds through here)."""
    return t.detach().to(device=device, dtype=dtype, copy=True).contiguous()


def _broadcast(tensors: list[tuple[str, torch.Tensor]], src: int, group) -> None:
    """Each tensor from global rank ``src`` to the rest of ``group``, in place (a function: no loop variable
    keeps the chunk's last tensor alive in the suspended export generator)."""
    for _, t in tensors:
        dist.broadcast(t, src=src, group=group)


def _export_buffer(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The receive buffer of a chunk tensor another pipeline stage makes (filled by the broadcast)."""
    return torch.empty(shape, device=device, dtype=dtype)


class MegatronPolicy:
    """GRPO on a megatron K3 stage with LoRA (see the module docstring). Built by ``build_megatron_policy``."""

    def __init__(self, trainer, cfg: K3Config, lora: LoRAConfig, pad_id: int, grpo: GRPOConfig | None = None,
                 max_tokens_per_micro_batch: int = 8192, parallel: tuple[int, int, int, int] = (1, 1, 1, 1),
                 dynamic_batch: bool = False) -> None:
        from megatron.core import parallel_state

        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch={max_tokens_per_micro_batch}: must be >= 1")
        self.trainer = trainer
        self.model = trainer.model[0].module  # the GPTModel under megatron's DDP
        self.cfg, self.lora, self.pad_id = cfg, lora, pad_id
        self.grpo = GRPOConfig() if grpo is None else grpo
        self.max_tokens = max_tokens_per_micro_batch
        self.parallel = tuple(parallel)
        tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
        # sequence lengths: CP cuts 2·CP chunks, and each rank's tokens are split again over TP (SP)
        self.seq_unit = tp * (2 * cp if cp > 1 else 1)
        self.tp, self.cp = tp, cp
        self.dynamic_batch = bool(dynamic_batch)
        self.conv_halo = cfg.linear_attn_config.short_conv_kernel_size - 1  # under CP, each chunk holds one
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self._dp_group = parallel_state.get_data_parallel_group()
        self.steps = 0

    # -- batches
    def _pack(self, trajs: Sequence[Trajectory], with_targets: bool):
        """This rank's micro-batches of the global batch ``trajs`` and, per micro-batch, the index in ``trajs``
        of each row (-1: a padding row)."""
        from k3.megatron.training import MicroBatch

        longest = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs) - 1
        seq = max(1, math.ceil(longest / self.seq_unit)) * self.seq_unit
        mine = list(range(self.dp_rank, len(trajs), self.dp))
        per_rank = math.ceil(len(trajs) / self.dp)  # the same on every rank: equal micro-batch counts
        n_mb = math.ceil(per_rank / max(1, self.max_tokens // seq))
        rows = math.ceil(per_rank / n_mb)  # balanced: padding rows only in the last micro-batch
        mine += [-1] * (n_mb * rows - len(mine))
        batches, index = [], []
        for k in range(n_mb):
            idx = mine[k * rows:(k + 1) * rows]
            ids = torch.full((rows, seq + 1), self.pad_id, dtype=torch.long)
            mask = torch.zeros((rows, seq), dtype=torch.float32)
            old = torch.zeros((rows, seq), dtype=torch.float32)
            adv = torch.zeros(rows, dtype=torch.float32)
            for r, i in enumerate(idx):
                if i < 0:
                    continue
                t = trajs[i]
                ids[r, :len(t.prompt_ids) + len(t.response_ids)] = torch.tensor(t.prompt_ids + t.response_ids)
                p, n = len(t.prompt_ids), len(t.response_ids)
                mask[r, p - 1:p - 1 + n] = 1.0
                if with_targets:
                    old[r, p - 1:p - 1 + n] = torch.tensor(t.old_log_probs, dtype=torch.float32)
                    adv[r] = t.advantage
            extra = {"old_log_probs": old, "advantages": adv} if with_targets else {}
            batches.append(MicroBatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask, extra))
            index.append(idx)
        return batches, index

    def _pack_dynamic(self, trajs: Sequence[Trajectory], with_targets: bool):
        """This rank's packed micro-batches of the global batch ``trajs`` (``plan_micro_batches``; rows laid out by
        ``packed_bounds``) and, per micro-batch, ``(index in trajs, start of its segment)`` of each trajectory."""
        from k3.megatron.packing import packed_bounds, plan_micro_batches, sample_mean_weights
        from k3.megatron.training import MicroBatch

        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        plan = plan_micro_batches(lengths, self.dp, self.max_tokens, self.cp)[self.dp_rank]
        batches, index = [], []
        for idx in plan:
            cu = packed_bounds([lengths[i] for i in idx], self.tp, self.cp, self.conv_halo)
            T = int(cu[-1])
            ids = torch.full((1, T), self.pad_id, dtype=torch.long)
            labels = torch.full((1, T), self.pad_id, dtype=torch.long)
            mask, old, adv = torch.zeros(1, T), torch.zeros(1, T), torch.zeros(1, T)
            placed = []
            for j, i in enumerate(idx):
                t, start, end = trajs[i], int(cu[j]), int(cu[j + 1])
                p, n = len(t.prompt_ids), len(t.response_ids)
                tokens = torch.tensor(list(t.prompt_ids) + list(t.response_ids))
                ids[0, start:start + p + n] = tokens
                labels[0, start:start + p + n - 1] = tokens[1:]
                resp = slice(start + p - 1, start + p - 1 + n)  # response token j is predicted at p − 1 + j
                mask[0, resp] = 1.0
                if with_targets:
                    old[0, resp] = torch.tensor(t.old_log_probs, dtype=torch.float32)
                    adv[0, start:end] = float(t.advantage)
                placed.append((i, start))
            extra = {}
            if with_targets:
                extra = {"old_log_probs": old, "advantages": adv, "weights": sample_mean_weights(mask, cu, len(trajs))}
            batches.append(MicroBatch(ids, labels, mask, extra, cu_seqlens=cu))
            index.append(placed)
        return batches, index

    def _gather_dp(self, mine: dict[int, Any]) -> dict[int, Any]:
        if self.dp == 1:
            return mine
        parts: list[dict | None] = [None] * self.dp
        dist.all_gather_object(parts, mine, group=self._dp_group)
        return {k: v for part in parts for k, v in part.items()}

    # -- GRPO
    def log_probs(self, trajs: Sequence[Trajectory]) -> list[list[float]]:
        """Per-token log-probabilities of each trajectory's response under the current policy (nats)."""
        if not trajs:
            return []
        mine: dict[int, list[float]] = {}
        if self.dynamic_batch:
            batches, placed = self._pack_dynamic(trajs, with_targets=False)
            for out, where in zip(self.trainer.forward(batches), placed):
                logp = out.log_probs.float().cpu()[0]
                for i, start in where:
                    p, n = len(trajs[i].prompt_ids), len(trajs[i].response_ids)
                    mine[i] = logp[start + p - 1:start + p - 1 + n].tolist()
            got = self._gather_dp(mine)
            return [got[i] for i in range(len(trajs))]
        batches, index = self._pack(trajs, with_targets=False)
        outs = self.trainer.forward(batches)
        for mb, out, idx in zip(batches, outs, index):
            logp = out.log_probs.float().cpu()
            for r, i in enumerate(idx):
                if i >= 0:
                    mine[i] = logp[r][mb.loss_mask[r].bool()].tolist()
        got = self._gather_dp(mine)
        return [got[i] for i in range(len(trajs))]

    def train_step(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step over ``trajs`` (a global batch): token-mean PPO-clip loss over all its response
        tokens, gradients accumulated over micro-batches, global-norm clipping, AdamW on the LoRA factors.
        Returns the torch backend's ``train/*`` metrics."""
        if not trajs:
            raise ValueError("train_step needs at least one trajectory")
        for t in trajs:
            if t.old_log_probs is None or len(t.old_log_probs) != len(t.response_ids):
                raise ValueError("every trajectory needs old_log_probs, one per response token")
        num_tokens = sum(len(t.response_ids) for t in trajs)
        g = self.grpo

        def grpo_loss(mb, out, ctx):
            mask = mb.loss_mask.bool()
            if self.dynamic_batch:  # the recipe's loss: per-response token means, averaged over the global batch
                w = mb.extra["weights"]
                pl = policy_loss(out.log_probs, mb.extra["old_log_probs"], mb.extra["advantages"], mask,
                                 eps_clip=g.eps_clip, eps_clip_high=g.eps_clip_high, token_weights=w)
                entropy = (out.entropy * w).sum()
            else:
                pl = policy_loss(out.log_probs, mb.extra["old_log_probs"], mb.extra["advantages"], mask,
                                 eps_clip=g.eps_clip, eps_clip_high=g.eps_clip_high, num_tokens=num_tokens)
                entropy = (out.entropy * mb.loss_mask).sum() / num_tokens
            return pl.loss, {"pg_clipfrac": pl.pg_clipfrac, "ppo_kl": pl.ppo_kl, "entropy": entropy}

        if self.dynamic_batch:
            batches, _ = self._pack_dynamic(trajs, with_targets=True)
        else:
            batches, _ = self._pack(trajs, with_targets=True)
        stats = self.trainer.step(batches, grpo_loss, with_entropy=True, step_index=self.steps)
        self.steps += 1
        return {
            "train/loss": stats["loss"],
            "train/pg_clipfrac": stats["pg_clipfrac"],
            "train/ppo_kl": stats["ppo_kl"],
            "train/entropy": stats["entropy"],
            "train/grad_norm": stats["grad_norm"],
            "train/num_tokens": float(num_tokens),
        }

    # -- adapters
    def _export_plan(self) -> _ExportPlan:
        """Which pipeline stage produces each ``chunk_layout`` chunk, and from which of this stage's factors;
        checks the adapters against the layout without moving any adapter data (collective over PP).

        Each stage maps its own factors to PEFT names and shapes from their global shapes alone (meta tensors)
        and compares them with the layout's chunks of its own layers: exactly those names, each with its
        shape. The stages all-gather which layers they hold and how many problems they found, so every rank
        raises the same ``ExportError`` (naming the stage) or none does."""
        from megatron.core import parallel_state

        from k3.megatron.lora import lora_factors

        layout = chunk_layout(self.cfg, self.lora)
        n_layers = self.cfg.num_hidden_layers
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        held = sorted({layer.layer_idx for layer in self.model.decoder.layers})
        past = [i for i in held if not 0 <= i < n_layers]
        problems = [f"layers {past} are past num_hidden_layers={n_layers}"] if past else []
        source: dict[str, str] = {}  # PEFT name -> the megatron factor it comes from
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in lora_factors(self.model):
            try:
                hf = megatron_lora_to_hf({name: torch.empty(shape, device="meta")}, self.cfg)
            except NameMapError as e:
                problems.append(str(e))
                continue
            for n, t in hf.items():
                if n in source:
                    problems.append(f"{n} comes from both {source[n]} and {name}")
                source[n], shapes[n] = name, tuple(t.shape)
        mine = set(held)
        expected = {n: shape for spec in layout if spec.layer in mine for n, shape in spec.tensors}
        missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
        wrong = [f"{n} {shapes[n]} (expected {expected[n]})" for n in sorted(set(expected) & set(shapes))
                 if shapes[n] != expected[n]]
        problems += [f"{len(x)} {what}: {x[:3]}" for x, what in
                     ((missing, "missing"), (unexpected, "unexpected"), (wrong, "with the wrong shape")) if x]

        # [stage, layer] = 1 where the stage holds the layer; the last column: the stage's problem count
        row = torch.zeros(n_layers + 1, dtype=torch.int64, device=self._export_device)
        row[[i for i in held if i not in past]] = 1
        row[n_layers] = len(problems)
        if pp > 1:
            rows = [torch.empty_like(row) for _ in range(pp)]
            dist.all_gather(rows, row, group=pp_group)
            table = torch.stack(rows).cpu()
        else:
            table = row.cpu()[None]
        holders = table[:, :n_layers].sum(0)
        unheld = [i for i in range(n_layers) if holders[i] != 1]
        if int(table[:, n_layers].sum()) or unheld:
            if pp > 1:  # the error path only: the stages' messages (short strings) to every rank
                every: list[list[str] | None] = [None] * pp
                dist.all_gather_object(every, problems, group=pp_group)
                problems = [f"pipeline stage {k}: {m}" for k, ms in enumerate(every) for m in ms]
            if unheld:
                problems.append(f"layers {unheld} are held by {[int(holders[i]) for i in unheld]} pipeline "
                                "stages (expected exactly 1)")
            raise ExportError("the megatron model's adapters are not the expected set: " + "; ".join(problems))
        owner = [int(table[:, spec.layer].argmax()) for spec in layout]
        sources = [list(dict.fromkeys(source[n] for n, _ in spec.tensors)) if owner[k] == pp_rank else []
                   for k, spec in enumerate(layout)]
        return _ExportPlan(layout, owner, sources, pp_group, pp_rank)

    @property
    def _export_device(self) -> torch.device:
        """Where the export gathers and broadcasts: the parameters' device (CUDA under NCCL)."""
        return next(self.model.parameters()).device

    def _chunk_tensors(self, spec: ChunkSpec, factors: list[str], device: torch.device, dtype: torch.dtype,
                       into: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        """This stage's chunk ``spec`` from its megatron ``factors`` (collective over the stage's TP/EP): one
        global factor at a time, each turned into its PEFT tensors as fresh ``dtype`` copies on ``device``
        (or written into the given ``into`` views, by name) before the next is gathered, so at most the chunk
        plus one global factor is held."""
        from k3.megatron.lora import iter_lora

        out: dict[str, torch.Tensor] = {}
        for name, factor in iter_lora(self.model, factors):
            # a comprehension: no loop variable keeps a piece (a view of the factor) alive past ``del factor``
            out.update({n: _export_copy(piece, device, dtype) if into is None else into[n].copy_(piece.detach())
                        for n, piece in megatron_lora_to_hf({name: factor}, self.cfg).items()})
            del factor  # before the next factor is gathered
        return [(n, out.pop(n)) for n, _ in spec.tensors]

    def export_chunks(self, version: int, device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.bfloat16, out: ChunkAllocator | None = None) -> Iterator[AdapterChunk]:
        """The adapters as ``AdapterChunk``s in ``chunk_layout`` order (fresh contiguous ``dtype`` copies on
        ``device``, default the parameters'); the set is checked before the first chunk (``ExportError``).
        ``out``: as ``k3.lora.export.export_chunks``' (each chunk written into one tensor from it), where the chunk
        is made on its final device (one stage, or ``device`` None or the stages' export device).

        Collective over TP/EP/PP: every rank calls it and runs the stream to its end, and every rank gets
        every chunk, in the same order (an engine feeder may be any rank; recipe §4.4). A chunk is made by
        the pipeline stage holding its layer (``iter_lora``: one TP/EP-gathered factor at a time) and, under
        PP, broadcast tensor by tensor from that stage over the PP group into buffers the other stages
        allocate from the layout's shapes. Nothing beyond the parameters is held but the chunk being made or
        yielded (plus, on its stage, the global factor being converted), if the caller drops each chunk
        before taking the next."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"export_chunks: version={version!r}: expected an integer >= 0")
        plan = self._export_plan()
        config = self.lora.peft_config()
        pp = dist.get_world_size(plan.pp_group)
        comm = self._export_device
        made_on = comm if pp > 1 or device is None else torch.device(device)
        moved = pp > 1 and device is not None and resolved_device(device) != resolved_device(comm)  # copied after
        in_place = out is not None and not moved

        def stream() -> Iterator[AdapterChunk]:
            last = len(plan.layout) - 1
            for k, spec in enumerate(plan.layout):
                into = None
                if in_place:
                    flat = out(sum(math.prod(shape) for _, shape in spec.tensors), dtype, made_on)
                    into = dict(zip((n for n, _ in spec.tensors), flat_views(flat, [s for _, s in spec.tensors])))
                    del flat
                if plan.owner[k] == plan.pp_rank:
                    tensors = self._chunk_tensors(spec, plan.sources[k], made_on, dtype, into)
                elif into is not None:
                    tensors = list(into.items())  # the broadcast fills them
                else:
                    tensors = [(n, _export_buffer(shape, comm, dtype)) for n, shape in spec.tensors]
                del into
                if pp > 1:
                    _broadcast(tensors, dist.get_global_rank(plan.pp_group, plan.owner[k]), plan.pp_group)
                    if moved:
                        tensors = [(n, t.to(device)) for n, t in tensors]
                yield AdapterChunk(tensors, version, is_first=k == 0, is_last=k == last, config=dict(config),
                                   group=spec.group, layer=spec.layer)
                del tensors

        return stream()

    def save_adapter(self, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's layout, BF16, the torch backend's
        ``save_peft_adapter`` files) into ``directory``, atomically per file; global rank 0 writes. Collective
        (``export_chunks``' stream): rank 0 collects the whole adapter on CPU, the others drop each chunk."""
        writer = not dist.is_initialized() or dist.get_rank() == 0
        tensors: dict[str, torch.Tensor] = {}
        for chunk in self.export_chunks(self.steps, device="cpu" if writer else None):
            if writer:
                tensors.update(chunk.tensors)
            del chunk  # the others hold one chunk at a time
        directory = Path(directory)
        if writer:
            write_peft_adapter(directory, tensors, self.lora, base_model_name_or_path)
        if dist.is_initialized():
            dist.barrier()
        return directory

    def load_adapter(self, directory: str | Path) -> None:
        """Load a PEFT adapter directory (either backend's ``save_adapter``) into the adapters. Its rank, alpha
        and targets must be this policy's (``LoRAConfigError``); its tensors exactly ``chunk_layout``'s names
        and shapes (``ExportError``); missing files raise ``FileNotFoundError``."""
        from k3.megatron.lora import load_lora

        saved, cfg_path, weights_path = read_peft_adapter_config(directory)
        have = self.lora
        if (saved.rank, saved.alpha, saved.target_modules) != (have.rank, have.alpha, have.target_modules):
            raise LoRAConfigError(f"{cfg_path}: r={saved.rank}, alpha={saved.alpha:g}, targets "
                                  f"{list(saved.target_modules)} do not match the policy's adapters (r={have.rank}, "
                                  f"alpha={have.alpha:g}, targets {list(have.target_modules)})")
        with safe_open(str(weights_path), framework="pt") as f:
            named = {k.removeprefix(PEFT_PREFIX): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open
        shapes = {name: shape for spec in chunk_layout(self.cfg, self.lora) for name, shape in spec.tensors}
        missing, unexpected = sorted(set(shapes) - set(named)), sorted(set(named) - set(shapes))
        wrong = [f"{n} {tuple(named[n].shape)} (expected {shapes[n]})" for n in sorted(set(shapes) & set(named))
                 if tuple(named[n].shape) != shapes[n]]
        problems = [f"{len(x)} {what}: {x[:3]}" for x, what in
                    ((missing, "missing"), (unexpected, "unexpected"), (wrong, "with the wrong shape")) if x]
        if problems:
            raise ExportError(f"{weights_path}: not this model's adapter: " + "; ".join(problems))
        load_lora(self.model, hf_lora_to_megatron(named, self.cfg))
        # A mixed-precision optimizer (BF16 parameters) steps fp32 main copies of the parameters, and the CPU
        # offload host copies of those: refresh them from what was just loaded, or the next step would write the
        # old adapters back over it.
        from k3.megatron.optimizer import reload_main_params

        reload_main_params(self.trainer.optimizer)

    # -- optimizer state
    def optimizer_state(self) -> dict[str, Any]:
        """Megatron's optimizer state (this rank's: ``k3.megatron.optimizer.optimizer_state_dict``; with the
        distributed optimizer, this rank's slice), whether it is the distributed optimizer's, which optimizer
        (``adam`` / ``sgd``), the step count and the layout it belongs to."""
        from k3.megatron.optimizer import is_distributed, optimizer_kind, optimizer_state_dict

        optimizer = self.trainer.optimizer
        return {"backend": BACKEND, "parallel": list(self.parallel), "dp": self.dp,
                "distributed_optimizer": is_distributed(optimizer), "optimizer_kind": optimizer_kind(optimizer),
                "optimizer": optimizer_state_dict(optimizer), "steps": self.steps}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore ``optimizer_state()`` output (collective over the data-parallel ranks with the distributed
        optimizer); a state of the torch backend, of another layout, of the other kind of optimizer (plain /
        distributed; a state without the tag is the plain one's) or of the other optimizer (Adam / SGD; untagged:
        Adam) raises ``ValueError``. The run's hyperparameters stay in effect."""
        from k3.megatron.optimizer import is_distributed, load_optimizer_state_dict

        backend = state.get("backend", "torch")
        if backend != BACKEND:
            raise ValueError(f"the optimizer state was saved by the {backend} backend; this run trains with "
                             f"--backend {BACKEND}: resume with the run's backend, or start a new run")
        layout = (list(state.get("parallel", [])), state.get("dp"))
        if layout != (list(self.parallel), self.dp):
            raise ValueError(f"the optimizer state was saved under (TP, EP, PP, CP) = {layout[0]}, DP {layout[1]}; "
                             f"this run has {list(self.parallel)}, DP {self.dp}: resume with the same layout")
        saved, have = bool(state.get("distributed_optimizer", False)), is_distributed(self.trainer.optimizer)
        if saved != have:
            kinds = {True: "the distributed optimizer", False: "the plain (non-distributed) optimizer"}
            raise ValueError(f"the optimizer state was saved by {kinds[saved]}; this run uses {kinds[have]}: resume "
                             "with the optimizer that saved it")
        # untagged states predate SGD: Adam's (load_optimizer_state_dict refuses the other kind, one line)
        load_optimizer_state_dict(self.trainer.optimizer, state["optimizer"], self.trainer.model,
                                  saved_kind=state.get("optimizer_kind", "adam"))
        self.steps = int(state["steps"])

    # -- memory (k3.rl.trainers.memory_regions)
    def grad_buffers(self) -> DDPGradBuffers:
        """The DDP gradient buffers, for the trainer's sleep."""
        return DDPGradBuffers(self.trainer.model)

    def close(self) -> None:
        """Tear down megatron's groups and the process group."""
        from k3.megatron.parallel import destroy_parallel

        destroy_parallel()
