"""The recipe's loop on one machine: rollout → reward → GRPO step → adapter sync → eval → adapter checkpoint.

``run(settings)`` is what ``k3 train`` calls (``k3.launch.train.run_resolved``) with the run's typed settings
(``k3.settings.run.RunSettings``), built once from the resolved flags; the loop hands each part its own section.
The trainer and the rollout engines (started by the engine registered under ``--rollout-engine``: ``k3.rl.engines``,
``k3.rollout.registry``) run as Ray actors in the placement-group bundles of the training ranks (colocated):
the torch trainer is one rank, the megatron trainer one actor per training rank (``k3.rl.trainers.group``; the
first rank on each engine's GPUs sends that engine its adapters); memory is
handed between them in the order of ``--colocate-memory-peak-device`` (recipe §5.4, ``k3.rl.colocate``),
every sync pauses generation on every engine and continues it only after every trainer rank returned, and
every sync is bracketed by per-rank memory records that the harness checks. The run directory follows
docs/RUN_DIRECTORY.md (events: ``k3.rl.metrics``; adapter checkpoints and resume: ``k3.rl.resume``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import torch

from k3.kernels import availability as triton_availability
from k3.megatron import backend as megatron_backend
from k3.rl import colocate
from k3.rl.data.chat import encode_prompt
from k3.rl.data.order import prompts_for_rollout
from k3.rl.data.records import load_prompts
from k3.rl.delivery import delivery_keys, delivery_problems
from k3.rl.engines import (BREAK_SYNC_ENV, check_engine_available, connect_engines, feeding_ranks,
                           shutdown_engines, start_engines)
from k3.rl.errors import TrainingError, last_line
from k3.rl.grpo import GRPOConfig, group_advantages
from k3.rl.handles import LocalHandle, RayHandle, call_all, submit
from k3.rl.metrics import MetricsWriter
from k3.rl.on_policy import token_kl
from k3.rl.progress import RolloutProgress
from k3.rl.resume import (latest_checkpoint, load_checkpoint_state, load_optimizer_state, next_sync_index,
                          save_checkpoint)
from k3.rl.reward.reward import get_reward_fn
from k3.rl.step_profile import PROFILE_DIR, PROFILED_STEP
from k3.rl.trainer_worker import TrainerWorker
from k3.rl.trainers.group import TrainerGroup, is_trainer_group
from k3.rl.trainers.trajectory import Trajectory
from k3.rollout.protocol import GenerateRequest, SamplingParams
from k3.rollout.registry import engine_kind
from k3.settings.run import RunSettings
from k3.settings.worker import WorkerSpec
from k3.tokenizer import load_tokenizer

__all__ = ["Loop", "TrainingError", "run", "worker_spec"]


# ------------------------------------------------------------------------------------------------ the loop
class Loop:
    """One run. ``trainer`` and each engine are handles with a ``call(method, *args)`` facade (Ray or in-process);
    ``engines`` is one handle or a list of them (one per rollout engine). ``trainer`` may be a
    ``k3.rl.trainers.group.TrainerGroup`` (one actor per training rank): its ``call`` runs the method on every rank
    and returns the results in rank order; rank 0's log-probs and metrics are the run's."""

    def __init__(self, settings: RunSettings, trainer: Any, engines: Any, writer: MetricsWriter) -> None:
        self.s = settings
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not self.engines:
            raise TrainingError("the loop needs at least one rollout engine")
        self.trainer, self.engine, self.w = trainer, self.engines[0], writer
        self._group = is_trainer_group(trainer)
        self.engine_kind = engine_kind(settings.rollout_engine)
        self._offload_train = settings.colocate.offload_train
        if self._offload_train:  # the recipe's trainer steps are required then, never silently skipped
            has = getattr(trainer, "has", None)
            missing = [m for m in colocate.TRAINER_METHODS if has is None or not has(m)]
            if missing:
                raise TrainingError(f"--offload-train needs a trainer with {', '.join(colocate.TRAINER_METHODS)}; "
                                    f"this one has no {', '.join(missing)} (pass --no-offload-train to keep it "
                                    "resident)")
        self.tokenizer = load_tokenizer(settings.tokenizer_path)
        self.train_records = load_prompts(settings.data.prompt_data)
        self.eval_records = load_prompts(settings.data.eval_prompt_data) if settings.data.eval_prompt_data else []
        self.eval_name = settings.data.eval_dataset_name
        self.reward_fn = get_reward_fn(settings.reward_model)
        self.version = 0  # the adapter version the engines serve; a resume sets the checkpoint's
        self.next_sync = 0  # the next sync's index in the run; a resume continues it (next_sync_index)
        self.progress = RolloutProgress(settings.num_rollout)

    # -- pieces
    def _encode(self, rec: dict) -> list[int]:
        return encode_prompt(self.tokenizer, rec["prompt"])

    def _sampling(self, eval_: bool, seed: int) -> SamplingParams:
        ro = self.s.rollout
        if eval_:
            return SamplingParams(temperature=ro.eval_temperature, top_p=1.0,
                                  max_new_tokens=ro.eval_max_response_len, seed=seed)
        return SamplingParams(temperature=ro.rollout_temperature, top_p=ro.rollout_top_p,
                              max_new_tokens=ro.rollout_max_response_len, seed=seed)

    def _reward(self, sample, label: str) -> float:
        return float(self.reward_fn(sample.text, label, tokens=sample.tokens))

    def sync(self, rollout_id: int | None, cycle_start: float | None = None,
             onload_time: float | None = None) -> dict[str, Any]:
        """Adapter version + 1: export → hand-off → the engine must then serve exactly that version.

        ``rollout_id`` None is the startup sync. ``cycle_start`` (perf_counter) is where this rollout's cycle
        began, for ``perf/cycle_time`` (generate + train + sync; evals are outside cycles). ``onload_time``: seconds
        of the memory moves since training (``perf/onload_time``)."""
        version = self.version + 1
        sync_index = self.next_sync
        # Recipe §5.4 step 6: generation is paused on every engine before the first chunk goes out.
        self._on_engines("pause_generation")
        try:
            outs = _rank_results(self.trainer.call("update_weights", version))
        except Exception as e:  # Ray wraps the trainer's HandoffError; its text carries the cause
            raise TrainingError(
                f"adapter sync of version {version} failed ({type(e).__name__}: {last_line(e)}); the engine "
                f"keeps serving version {self.version}. Restart with --resume to continue from the last adapter "
                "checkpoint"
            ) from e
        # Step 7: every trainer rank returned from update_weights, its sync cleanup included: only now may the
        # engines generate again (an engine resuming earlier OOMed resuming its KV cache in the recipe).
        self._on_engines("continue_generation")
        for out in outs:  # one record per rank and phase (the harness's returns_to_baseline is per rank)
            for rec in out["memory"]:
                keys = {k: v for k, v in rec.items() if k not in ("time", "event")}
                self.w.write("memory", rollout_id, sync=sync_index, **keys)
        chunks = {o["chunks"] for o in outs}
        if len(chunks) != 1:  # every rank runs the same collective stream: a difference is a broken export
            raise TrainingError(f"the trainer ranks exported different chunk counts for version {version}: "
                                f"{[o['chunks'] for o in outs]}")
        leaks = [f"rank {r}: {p}" if len(outs) > 1 else p for r, o in enumerate(outs)
                 for p in o.get("leak_problems") or []]
        out = outs[0]
        # The engines' own answers (k3.rl.delivery): the version each reports active and the digest of every chunk
        # it activated. The event carries them before anything is judged, so the harness sees a broken sync too.
        reports = self._on_engines("adapter_report")
        trained = out.get("chunk_digests", [])
        keys = {"sync": sync_index, "adapter/version": version, "adapter/chunks": out["chunks"],
                "perf/update_weights_time": out["perf/update_weights_time"],
                **delivery_keys(trained, reports, version)}
        if leaks:
            keys["leak"] = "; ".join(leaks)
            print(f"WARNING sync {sync_index}: {keys['leak']}", flush=True)
        if cycle_start is not None:
            keys["perf/cycle_time"] = time.perf_counter() - cycle_start
        if onload_time is not None:
            keys["perf/onload_time"] = onload_time
        self.w.write("sync", rollout_id, **keys)
        for k, report in enumerate(reports):
            if report["version"] != version:
                which = "the engine" if len(self.engines) == 1 else f"engine {k}"
                raise TrainingError(
                    f"after update_weights {which} serves adapter version {report['version']}, expected {version}: "
                    "the adapter sync is broken (the engine kept an old version)"
                )
        problems = delivery_problems(trained, reports, version)
        if problems:
            raise TrainingError(f"adapter sync {sync_index} did not deliver what was trained: {'; '.join(problems)}")
        self.version = version
        self.next_sync = sync_index + 1
        print(f"LoRA weight version {version} sent in {out['chunks']} chunks", flush=True)
        return out

    def evaluate(self, rollout_id: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        reqs = [GenerateRequest(self._encode(r), {"label": r["label"]}) for r in self.eval_records]
        samples = self._generate(reqs, self._sampling(True, self.s.seed))
        rewards = [self._reward(s, s.meta["label"]) for s in samples]
        n_correct = int(sum(r >= 1.0 for r in rewards))
        rec = {
            f"eval/{self.eval_name}": sum(rewards) / max(len(rewards), 1),
            f"eval/{self.eval_name}/n_correct": n_correct,
            f"eval/{self.eval_name}/n": len(rewards),
            f"eval/{self.eval_name}-truncated_ratio": sum(s.finish_reason == "length" for s in samples)
            / max(len(samples), 1),
            "perf/eval_time": time.perf_counter() - t0,
            "adapter_version": self.version,
        }
        self.w.write("eval", rollout_id, **rec)
        print(f"eval {rollout_id}: {self.eval_name} {rec[f'eval/{self.eval_name}']:.3f} "
              f"({n_correct}/{len(rewards)})", flush=True)
        return rec

    def rollout_and_train(self, rollout_id: int) -> dict[str, Any]:
        s, ro = self.s, self.s.rollout
        t_cycle = time.perf_counter()
        self.progress.begin(rollout_id)
        idx = prompts_for_rollout(len(self.train_records), rollout_id, s.rollout_batch_size, s.seed,
                                  ro.rollout_shuffle)
        reqs = []
        for i in idx:  # prompt-major: the n samples of one prompt are contiguous (one GRPO group)
            rec = self.train_records[i]
            ids = self._encode(rec)
            reqs += [GenerateRequest(ids, {"label": rec["label"], "prompt_index": i})
                     for _ in range(s.n_samples_per_prompt)]
        t0 = time.perf_counter()
        samples = self._generate(reqs, self._sampling(False, s.seed * 7919 + rollout_id))
        rollout_time = time.perf_counter() - t0
        stale = [s.adapter_version for s in samples if s.adapter_version != self.version]
        if stale:
            raise TrainingError(f"rollout {rollout_id}: samples from adapter version {stale[0]}, the trainer "
                                f"is at version {self.version}")
        rewards = torch.tensor([self._reward(s, s.meta["label"]) for s in samples])
        adv = group_advantages(rewards, s.n_samples_per_prompt, std_normalize=s.grpo.grpo_std_normalization,
                               eps=s.grpo.grpo_std_eps)
        lens = [len(s.tokens) for s in samples]
        rec = {
            "rollout/raw_reward": float(rewards.mean()),
            "rollout/advantages": float(adv.mean()),
            "rollout/response_len/mean": sum(lens) / len(lens),
            "rollout/response_len/max": max(lens),
            "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/zero_std_ratio":
                float((rewards.reshape(-1, s.n_samples_per_prompt).std(-1) == 0).float().mean()),
            "perf/rollout_time": rollout_time,
            "adapter_version": self.version,
        }
        self.w.write("rollout", rollout_id, **rec)  # written now, so a live watch sees the reward at once

        # Colocated hand-off, recipe §5.4: the engines give up their memory while the trainer works.
        t0 = time.perf_counter()
        self._run_steps(colocate.before_train_steps(self._peak, self._levels, self._offload_train), rollout_id,
                        self.next_sync)
        offload_time = time.perf_counter() - t0
        trajs = [Trajectory(s.prompt_ids, s.tokens, float(adv[k])) for k, s in enumerate(samples)]
        t0 = time.perf_counter()
        old = self._rank0(self.trainer.call("log_probs", trajs))
        log_probs_time = time.perf_counter() - t0
        for t, lp in zip(trajs, old):
            t.old_log_probs = lp
        engine_lp = [lp for s in samples for lp in s.logprobs]
        trainer_lp = [lp for o in old for lp in o]
        t0 = time.perf_counter()
        train_metrics: dict[str, float] = {}
        profiled: dict[str, float] = {}  # the profiled step's index, whichever step of the rollout it was
        gbs = s.global_batch_size
        for start in range(0, len(trajs), gbs):  # one optimizer step per global batch
            train_metrics = self._rank0(self.trainer.call("train_step", trajs[start:start + gbs]))
            if PROFILED_STEP in train_metrics:
                profiled = {PROFILED_STEP: train_metrics.pop(PROFILED_STEP)}
            # Every rank's replicas of every adapter tensor, after every step (k3.rl.replicas)
            for replicas in _rank_list(self.trainer.call("replica_digests")):
                self.w.write("replicas", rollout_id, **replicas)
        train_time = time.perf_counter() - t0
        self.w.write("train", rollout_id, **train_metrics, **profiled, **{
            "perf/train_time": train_time,
            "perf/log_probs_time": log_probs_time,
            "perf/offload_time": offload_time,
            "rollout/log_probs": sum(trainer_lp) / max(len(trainer_lp), 1),
            "rollout/rollout_log_probs": sum(engine_lp) / max(len(engine_lp), 1),
            "rollout/train_rollout_logprob_abs_diff":
                sum(abs(x - y) for x, y in zip(trainer_lp, engine_lp)) / max(len(trainer_lp), 1),
            "rollout/train_rollout_kl": token_kl(engine_lp, trainer_lp),
        })
        t0 = time.perf_counter()
        self._run_steps(colocate.after_train_steps(self._peak, self._levels, self._offload_train), rollout_id,
                        self.next_sync)
        sync = self.sync(rollout_id, cycle_start=t_cycle, onload_time=time.perf_counter() - t0)
        self._run_steps(colocate.AFTER_SYNC, rollout_id, self.next_sync - 1)
        print(self.progress.finished(
            rollout_id, f"reward {rec['rollout/raw_reward']:.3f}  len {rec['rollout/response_len/mean']:.1f}  "
            f"rollout {rollout_time:.1f}s  train {train_time:.1f}s  "
            f"sync {sync['perf/update_weights_time'] * 1e3:.0f}ms  "
            f"mem {sync['memory'][-1]['memory/allocated_gb']:.3f} GB"), flush=True)
        return rec

    def first_sync(self) -> dict[str, Any]:
        """The startup sync (adapter version 1) in the recipe's startup order. An engine that took its memory at
        start (SGLang: KV cache, CUDA graphs) gave it up before the trainer was created (:func:`start_engines`);
        here the trainer goes to sleep (``--offload-train``), the engine weights come back (``cpu`` peak), the
        adapters go out, and the KV cache comes back. An engine that allocates per call (the embedded one) gave
        nothing up: the trainer sleeps, and the sync follows."""
        held = self.engine_kind.holds_memory_at_start
        self._run_steps(colocate.before_first_sync_steps(self._peak, self._levels, self._offload_train,
                                                         engines_released=held), None, self.next_sync)
        out = self.sync(None)
        if held:
            self._run_steps(colocate.AFTER_SYNC, None, self.next_sync - 1)
        return out

    # -- the colocated hand-off (k3.rl.colocate)
    @property
    def _peak(self) -> str:
        return self.s.colocate.colocate_memory_peak_device

    @property
    def _levels(self) -> list[str]:
        return list(self.s.colocate.offload_rollout_level)

    def _on_engines(self, method: str, *args: Any) -> list[Any]:
        return call_all(self.engines, method, *args)

    def _rank0(self, out: Any) -> Any:
        """Rank 0's result of a trainer call (the whole result of a one-rank trainer)."""
        return out[0] if self._group else out

    def _run_steps(self, steps: list[colocate.Step] | tuple[colocate.Step, ...], rollout_id: int | None,
                   sync: int) -> None:
        """Run ``steps`` in order; every memory move is bracketed by readings (``memory`` events with
        ``rollout_id`` and ``sync``: the sync the step precedes or belongs to)."""
        for step in steps:
            if step.target == colocate.ENGINES:
                self._engine_step(step, rollout_id, sync)
            else:
                self._trainer_step(step, rollout_id, sync)

    def _trainer_step(self, step: colocate.Step, rollout_id: int | None, sync: int) -> None:
        """One trainer memory step on every rank; each rank's readings (before/after) are written. A failure
        stops the run (the trainer names the rank and phase; a failed wake_up left it fully asleep)."""
        try:
            out = self.trainer.call(step.method)
        except Exception as e:  # noqa: BLE001 - Ray wraps the rank's TrainerMemoryError; its text names rank, phase
            raise TrainingError(f"the trainer's {step.method} failed ({type(e).__name__}: {last_line(e)}); the run "
                                "stops here. Restart with --resume to continue from the last adapter checkpoint"
                                ) from e
        for records in (out if self._group else [out]):
            for rec in records or []:
                self._write_memory(rec, rollout_id, sync)

    def _engine_step(self, step: colocate.Step, rollout_id: int | None, sync: int) -> None:
        """One engine memory step on every engine at once, each engine's memory read before and after."""
        kind = "release" if step.method == "release_memory" else "resume"
        self._engine_readings(f"before_{kind}", step.tags, rollout_id, sync)
        self._on_engines(step.method, *([list(step.tags)] if step.tags else []))
        self._engine_readings(f"after_{kind}", step.tags, rollout_id, sync)

    def _engine_readings(self, phase: str, tags: tuple[str, ...], rollout_id: int | None, sync: int) -> None:
        """One ``memory`` event per engine: the engine's own reading where it gives one (``memory_reading``),
        else the device reading of the trainer rank that feeds it (on CUDA: the same device, all of it)."""
        fallback: list[dict[str, Any]] | None = None
        for k, engine in enumerate(self.engines):
            has = getattr(engine, "has", None)
            if has is not None and has("memory_reading"):
                values = engine.call("memory_reading")
            else:
                if fallback is None:
                    fallback = _rank_list(self.trainer.call("device_memory"))
                feeders = feeding_ranks(len(self.engines), self.s.layout.rollout_tp_size, len(fallback)) \
                    if self._group else [0] * len(self.engines)
                values = fallback[feeders[k]]
            self._write_memory({**values, "engine": k, "phase": phase, "tags": list(tags)}, rollout_id, sync)

    def _write_memory(self, rec: dict[str, Any], rollout_id: int | None, sync: int) -> None:
        keys = {k: v for k, v in rec.items() if k not in ("time", "event", "rollout_id", "sync")}
        self.w.write("memory", rollout_id, sync=sync, **keys)

    def _generate(self, reqs: list[Any], sampling: Any) -> list[Any]:
        """Generate on every engine at once: contiguous shards of ``reqs`` (GRPO groups stay together when the
        shard sizes allow), samples back in request order. A shard's seed is offset by its first request's
        index, so request ``i`` samples with ``seed + i`` whatever the engine count (SGLang's per-request seeds)."""
        n = len(self.engines)
        if n == 1:
            return self.engine.call("generate", reqs, sampling)
        bounds = [len(reqs) * k // n for k in range(n + 1)]
        pending = []
        for k, engine in enumerate(self.engines):
            lo, hi = bounds[k], bounds[k + 1]
            if lo < hi:
                shard = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + lo)
                pending.append(submit(engine, "generate", reqs[lo:hi], shard))
        return [sample for wait in pending for sample in wait()]

    # -- checkpoints
    def save(self, rollout_id: int) -> Path:
        """Adapter (PEFT files) + optimizer state + loop state, atomically (``k3.rl.resume.save_checkpoint``)."""
        return save_checkpoint(self.s.run_dir, self.trainer, rollout_id, self.version)


def _rank_list(out: Any) -> list[dict[str, Any]]:
    """A trainer call's results as one per rank (a trainer group returns a list; one rank its own result)."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _rank_results(out: Any) -> list[dict[str, Any]]:
    """``update_weights`` results, one per trainer rank (a trainer group returns a list; one rank a dict)."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if not outs:
        raise TrainingError("update_weights returned no result from any trainer rank")
    return outs


def _require_expert_lora_kernel(kernel: str, device: str) -> None:
    """Stop at once where ``--expert-lora-kernel triton`` cannot run on the trainer's device (it would fail at the
    first training step, after the warm-up and the first rollout)."""
    if kernel in ("torch", "auto"):  # auto falls back to torch where the kernels cannot run
        return
    if not triton_availability.triton_available():
        raise TrainingError("--expert-lora-kernel triton needs Triton (on a CUDA machine: pip install triton); "
                            "use --expert-lora-kernel torch")
    if not triton_availability.triton_runs_on(device):
        raise TrainingError(f"--expert-lora-kernel triton: the Triton kernels run on a CUDA device and this run "
                            f"trains on {device}; use --expert-lora-kernel torch")


def _grpo_config(s: RunSettings) -> GRPOConfig:
    o = s.optimizer
    return GRPOConfig(eps_clip=s.grpo.eps_clip, eps_clip_high=s.grpo.eps_clip_high, std_eps=s.grpo.grpo_std_eps,
                      lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay,
                      optimizer=o.optimizer, sgd_momentum=o.sgd_momentum)


def worker_spec(s: RunSettings) -> WorkerSpec:
    """What the run's trainer and engine workers build their model from (the device: CUDA when the run uses GPUs
    and this process sees one)."""
    device = "cuda" if s.uses_gpus and torch.cuda.is_available() else "cpu"
    t, o = s.training, s.optimizer
    return WorkerSpec(model_dir=str(s.tokenizer_path), lora=s.lora, device=device,
                      dtype="bfloat16" if device == "cuda" else "float32", seed=s.seed,
                      expert_lora_kernel=t.expert_lora_kernel, transfer_buffer=t.lora_transfer_buffer,
                      # the recipe's perf settings as resolved_config prints them (the megatron trainer applies them)
                      use_dynamic_batch_size=t.use_dynamic_batch_size, recompute_granularity=t.recompute_granularity,
                      recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers,
                      gpu_memory_fraction_per_actor=s.colocate.gpu_memory_fraction_per_actor,
                      gpu_memory_gb_per_actor=s.colocate.gpu_memory_gb_per_actor,
                      # the optimizer's (megatron: resolve sets them for that backend only) and the guards (both)
                      use_distributed_optimizer=o.use_distributed_optimizer,
                      optimizer_cpu_offload=o.optimizer_cpu_offload,
                      optimizer_offload_fraction=o.optimizer_offload_fraction,
                      check_for_nan_in_loss_and_grad=t.check_for_nan_in_loss_and_grad,
                      distributed_timeout_minutes=t.distributed_timeout_minutes,
                      log_probs_chunk_size=t.log_probs_chunk_size,
                      offload_train=s.colocate.offload_train,
                      profile_train_step=t.profile_train_step, profile_dir=str(Path(s.run_dir) / PROFILE_DIR))


def _wandb_run(s: RunSettings, config: Mapping[str, Any] | None):
    """The recipe's W&B settings (project miles-run_kimi_k3_lora, group = run id); WANDB_MODE=offline works."""
    try:
        import wandb
    except ImportError:
        raise TrainingError("--enable-wandb needs wandb: pip install 'k3-lora-rl[logging]'") from None
    return wandb.init(project="miles-run_kimi_k3_lora", group=s.run_id, name=s.run_id,
                      dir=str(s.run_dir), config=dict(config) if config is not None else None)


def run(settings: RunSettings, *, in_process: bool | None = None, sabotage_sync: bool = False,
        start_placement: Callable[[], Any] | None = None, wandb_config: Mapping[str, Any] | None = None) -> int:
    """Run the loop; returns 0. ``in_process`` skips Ray (tests; default from ``K3_IN_PROCESS``). Under Ray,
    ``start_placement()`` places the run (the launcher's ``RayPlacement.start``: an object with
    ``create_actor``, ``actor_options`` and ``shutdown``). ``wandb_config``: the resolved config W&B records."""
    s = settings
    training = s.training
    engine = engine_kind(s.rollout_engine)
    if training.backend == "megatron":
        try:
            megatron_backend.require_cuda()  # looked up at call time: tests stand in a CPU guard
        except megatron_backend.MegatronBackendUnavailable as e:  # `k3 train` reports a TrainingError in one line
            raise TrainingError(str(e)) from None
    if not s.colocate.disable_weights_backuper:  # printed = in effect: no trainer here keeps such a copy
        raise TrainingError("disable_weights_backuper False asks for a separate host copy of the trainer's weights; "
                            "there is none here: with --offload-train the exporter reads the adapters from the "
                            "memory saver's own backups (the recipe's --disable-weights-backuper)")
    spec = worker_spec(s)
    _require_expert_lora_kernel(training.expert_lora_kernel, spec.device)
    if training.backend == "torch" and s.layout.world_size > 1:
        raise TrainingError(f"the torch backend trains on one rank, but this layout has "
                            f"{s.layout.world_size} training ranks: use --backend megatron")
    if in_process is None:
        in_process = os.environ.get("K3_IN_PROCESS") == "1"
    if in_process and s.layout.world_size > 1:
        # One process holds one rank; the ranks of a megatron layout are Ray actors (k3.rl.trainers.group).
        raise TrainingError(f"an in-process run (K3_IN_PROCESS=1) trains on one rank, but this layout has "
                            f"{s.layout.world_size} training ranks: run under Ray (unset K3_IN_PROCESS)")
    if not in_process and start_placement is None:
        raise TrainingError("a run under Ray needs its placement: pass start_placement (k3.launch.train does)")
    check_engine_available(s.rollout_engine, s.rollout, in_process)  # stops at once, before Ray or a model starts
    # Test hook: an engine that acks every chunk but never activates (keeps serving version 0).
    sabotage_sync = sabotage_sync or os.environ.get(BREAK_SYNC_ENV) == "1"
    if training.backend == "megatron":
        # the layout's TP/EP/PP/CP and, under an uneven split, first = ceil(L / PP), last = L - first·(PP - 1)
        spec = dataclasses.replace(spec, backend="megatron", ref_load=training.ref_load, layout=s.layout)
    grpo = _grpo_config(s)
    max_tokens = training.max_tokens_per_gpu
    writer = MetricsWriter(s.run_dir, wandb_run=_wandb_run(s, wandb_config) if s.enable_wandb else None)
    placement = None
    engines: list[Any] = []
    trainer: Any = None
    t_start = time.time()
    try:
        writer.write("status", None, status="started", run_id=s.run_id)
        # Engines first: an SGLang engine takes its memory when it starts and must give it up before the
        # trainer loads (start_engines).
        if in_process:
            engines = start_engines(s.rollout_engine, s.rollout, s.layout, s.colocate, spec, None, sabotage_sync)
            trainer = LocalHandle(TrainerWorker(spec, grpo, max_tokens))
        else:
            import ray

            placement = start_placement()
            engines = start_engines(s.rollout_engine, s.rollout, s.layout, s.colocate, spec, placement,
                                    sabotage_sync)
            if training.backend == "megatron":  # one actor per training rank, joined in one process group
                trainer = TrainerGroup.start(placement, s.layout.world_size, spec, grpo, max_tokens)
            else:
                trainer = RayHandle(placement.create_actor(ray.remote(TrainerWorker), 0, "trainer", spec, grpo,
                                                           max_tokens))
        connect_engines(trainer, engines, s.layout.rollout_tp_size)
        loop = Loop(s, trainer, engines, writer)
        start = 0
        ckpt = latest_checkpoint(s.run_dir) if s.resume else None
        if ckpt is not None:
            state = load_checkpoint_state(ckpt)
            trainer.call("load_adapter", str(ckpt))
            load_optimizer_state(trainer, state, optimizer=s.optimizer.optimizer)
            loop.version, loop.next_sync = int(state["version"]), next_sync_index(s.run_dir)
            start = int(state["rollout_id"]) + 1
            writer.write("status", None, status="resumed", next_rollout=start,
                         checkpoint=ckpt.relative_to(s.run_dir).as_posix())
        # The first sync ships the freshly initialised adapters (version 1), or the resumed ones (saved + 1).
        loop.first_sync()
        if loop.eval_records and not s.rollout.skip_eval_before_train and start == 0:
            loop.evaluate(0)
        interval = s.eval_interval
        for rid in range(start, s.num_rollout):
            loop.rollout_and_train(rid)
            last = rid == s.num_rollout - 1
            if loop.eval_records and interval and ((rid + 1) % interval == 0 or last):
                loop.evaluate(rid)
            if (rid + 1) % s.save_interval == 0 or last:
                loop.save(rid)
        writer.write("status", None, status="finished", wall_time_s=time.time() - t_start)
        return 0
    except BaseException as e:
        writer.write("status", None, status="failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        try:
            if in_process and trainer is not None:
                # No actor to kill: close the trainer (its producer first, then megatron's groups). The NCCL
                # process group must be destroyed before the interpreter exits, or its threads abort the
                # process after a finished run (seen on the H200: "terminate called without an active
                # exception", exit 134).
                _close_trainer(trainer)
            if engine.shutdown_with_run or in_process:
                shutdown_engines(engines)  # e.g. SGLang's processes go with their engine, not with its Ray actor
            if placement is not None:
                placement.shutdown()
        finally:
            writer.close()


def _close_trainer(trainer: Any) -> None:
    try:
        trainer.call("close")
    except Exception as e:  # noqa: BLE001 - the run's own result (or error) matters more than its teardown
        print(f"WARNING closing the trainer failed: {type(e).__name__}: {last_line(e)}", flush=True)
