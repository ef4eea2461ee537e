"""Replica consistency on 2 gloo ranks (CPU) at EP2 (issue #23, item 1): after every optimizer step each rank logs
the digests of the adapter tensors it holds (``TrainerWorker.replica_digests``' ``k3.rl.replicas``) into a run
directory, and the harness's ``replicas_agree`` criterion judges them. Healthy: every replica agrees. Planted
fault: rank 1 skips the cross-EP gradient sum of one shared factor (``w1_lora_A``: shared-outer A of fc1), as a
fused weight-gradient path that forgets it would (NVIDIA-NeMo/Megatron-Bridge#6009) — the criterion fails at
step 2 (at step 1 B = 0 gives A no gradient) naming that tensor and the two ranks."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from layout_parity import trajectories
from tiny_checkpoint import write_tiny_checkpoint

STEPS = 2
SKIPPED = "w1_lora_A"


def _worker(root: Path, fault: bool) -> None:
    import megatron_compat

    megatron_compat.install()
    import torch.distributed as dist
    from megatron.core import parallel_state

    import k3.megatron.grads as grads
    from k3.lora import LoRAConfig
    from k3.rl.grpo import GRPOConfig
    from k3.rl.replicas import replica_digests
    from k3.rl.trainers.megatron import build_megatron_policy
    from k3.settings.parallel import ParallelLayout

    base = write_tiny_checkpoint(root / f"rank{os.environ['RANK']}")  # each process its own copy
    policy = build_megatron_policy(base, LoRAConfig(rank=4, alpha=8.0), pad_id=0,
                                   grpo=GRPOConfig(lr=5e-3, weight_decay=0.0, clip_grad=0.0),
                                   max_tokens_per_micro_batch=24, seed=3,
                                   layout=ParallelLayout.model_parallel(ep=2))
    rank = dist.get_rank()
    if fault and rank == 1:
        real = grads.reduce_k3_grads

        def skipping(model):
            # Keep this rank's own share of the shared factor's gradient: the sum over EP still runs (it is
            # collective), its result is thrown away for this one parameter.
            kept = [(p, grads._grad(p).clone()) for chunk in model for p in chunk.parameters()
                    if getattr(p, "k3_lora_factor", None) == SKIPPED and grads._grad(p) is not None]
            real(model)
            for p, g in kept:
                grads._grad(p).data.copy_(g)

        grads.reduce_k3_grads = skipping
    trajs = trajectories(policy.cfg.vocab_size)
    for t, lp in zip(trajs, policy.log_probs(trajs)):
        t.old_log_probs = [x - 0.05 for x in lp]  # a ratio off 1: every factor gets a gradient
    lines = []
    for _ in range(STEPS):
        policy.train_step(trajs)
        lines.append({"time": time.time(), "event": "replicas", "rollout_id": policy.steps - 1, "rank": rank,
                      "step": policy.steps, "digests": replica_digests(policy.model)})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        run = root / "run"
        run.mkdir()
        events = [{"time": time.time(), "event": "status", "rollout_id": None, "status": "started"}]
        events += sorted((e for per_rank in gathered for e in per_rank), key=lambda e: (e["step"], e["rank"]))
        events.append({"time": time.time(), "event": "status", "rollout_id": None, "status": "finished"})
        (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    dist.barrier()
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2] == "fault")


def _judge(run: Path):
    from harness.criteria import evaluate
    from harness.readers import read_run
    from harness.tier import load_tier

    c = next(c for c in load_tier("4layer").criteria if c.kind == "replicas_agree")
    return evaluate(c, read_run(run, finished=True))


@pytest.mark.parametrize("mode", ["healthy", "fault"])
def test_replicas_at_ep2_agree_unless_a_rank_skips_the_shared_factors_ep_sum(tmp_path, mode):
    from megatron_compat import run_workers

    from harness.criteria import Status

    run_workers([__file__, str(tmp_path), mode], nproc=2, timeout=400)
    result = _judge(tmp_path / "run")
    if mode == "healthy":
        assert result.status is Status.PASS, result.summary
        assert result.evidence["replica_comparisons"] > 0 and result.evidence["ranks"] == [0, 1]
        return
    assert result.status is Status.FAIL, result.summary
    # Step 1 cannot drift: B starts at zero, so A's gradient is zero on every rank; step 2 is the first
    assert result.evidence["first_failing_step"] == 2 and result.evidence["rank_groups"] == [[0], [1]]
    assert result.evidence["tensor"].endswith(SKIPPED), result.evidence["tensor"]
    assert f"step 2: replicas of {result.evidence['tensor']} differ: rank 0 vs rank 1" == result.summary
